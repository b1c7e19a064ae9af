"""models/t5.py and its span corruption (models/span_corruption.py): the stage chain that carries the encoder's
output to every decoder stage, the objective's round trip, and paged training equal to the reference trainer."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from angel_jax.config import Config, MemoryConfig, ModelConfig, MoEConfig, OptimizerConfig, TrainConfig
from angel_jax.optim import make_optimizer
from angel_jax.schedule.blueprint import blueprint
from angel_jax.schedule.budgets import saved_input_bytes
from angel_jax.schedule.runtime import build_paged_runtime
from angel_jax.cli.plan import estimate_costs
from angel_jax.train.step import init_state, make_train_step
import models
from models import t5
from models.span_corruption import SpanCorruption
from tests.test_moe import _params as moe_params, compiled
from tests.test_paged import batches, state_bytes

# (Few distinct parameter shapes: an eager init compiles a program per shape.)
CFG = ModelConfig(name="t5", vocab_size=256, seq_len=32, d_model=32, n_layers=2, n_heads=2, mlp_hidden=32,
                  relative_buckets=8, relative_max_distance=16, compute_dtype="float32")
B = 3


def _rows(cfg: ModelConfig = CFG, seed: int = 1) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).integers(0, 256, (B, cfg.seq_len + 1)), jnp.int32)


# ------------------------------------------------------------------------------------------- span corruption


def _reconstruct(enc: np.ndarray, target: np.ndarray, c: SpanCorruption) -> np.ndarray:
    """The text that an encoder input and a decoder target were made from: each sentinel of the input replaced by
    the ids that follow the same sentinel in the target, up to the next sentinel."""
    is_sentinel = target >= c.vocab_size
    spans, current = {}, None
    for t, s in zip(target, is_sentinel):
        if s:
            current = spans.setdefault(int(t), [])
        else:
            current.append(int(t))
    out = []
    for e in enc:
        out += spans[int(e)] if e >= c.vocab_size else [int(e)]
    return np.asarray(out)


def test_span_corruption_round_trips_and_the_loss_rebuilds_it_from_the_targets():
    c = t5.corruption(CFG)
    assert (c.noise, c.spans, c.encoder_length, c.decoder_length) == (5, 2, 29, 7)
    rows = _rows()
    tokens, targets = rows[:, :-1], rows[:, 1:]
    mask, enc, target = jax.jit(lambda t: (m := c.noise_mask(t), c.encoder_input(t, m), c.decoder_target(t, m)))(tokens)
    enc, target = np.asarray(enc), np.asarray(target)
    for b in range(B):
        np.testing.assert_array_equal(_reconstruct(enc[b], target[b], c), np.asarray(tokens[b]))
        assert target[b][target[b] >= c.vocab_size].tolist() == [256, 257]  # the sentinels, in order
        assert enc[b][enc[b] >= c.vocab_size].tolist() == [256, 257]
    assert np.asarray(mask).sum(axis=1).tolist() == [c.noise] * B and not np.asarray(mask[:, 0]).any()
    assert len({tuple(np.flatnonzero(m)) for m in np.asarray(mask)}) == B  # each row its own spans
    # The model's loss sees only targets = row[:, 1:] and rebuilds the same decoder target: logits that predict
    # this target have (almost) no loss, logits of another row's target a large one.
    loss = jax.jit(t5.loss(CFG))
    logits = 30.0 * jax.nn.one_hot(target, c.table_size)
    assert float(loss(logits, targets)) < 1e-6
    assert float(loss(logits[::-1], targets)) > 10


def test_relative_buckets_are_t5s():
    """Bidirectional: exact distances below buckets / 4, then logarithmic to max_distance, keys before and after
    the query in separate halves; causal: only keys before the query, the same scheme over all the buckets."""
    rel = jnp.arange(-40, 41)
    both = np.asarray(t5.relative_bucket(rel, True, 8, 16))
    causal = np.asarray(t5.relative_bucket(rel, False, 8, 16))
    assert both[40] == 0 and both[41] == 5 and both[39] == 1 and both[0] == 3 and both[-1] == 7
    assert causal[40] == 0 and causal[41:].max() == 0 and causal[39] == 1 and causal[38] == 2
    assert causal[36] == 4 and causal[0] == 7 and list(causal[:40]) == sorted(causal[:40], reverse=True)


# --------------------------------------------------------------------------------------------------- stages


@functools.lru_cache(maxsize=1)
def _init() -> dict:
    return models.get(CFG).init(0)[1]


def test_every_stage_initialised_alone_equals_the_whole_model_split_bit_for_bit():
    staged = models.get(CFG)
    names = [s.name for s in staged.stages]
    assert names == ["embed", "encoder.0", "encoder.1", "encoder_norm", "decoder.0", "decoder.1", "head"]
    merged = staged.merge(staged.split(_init()))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(_init())))
    whole = staged.split(_init())
    for i, stage in enumerate(staged.stages):
        alone = staged.init_stage(0, i)
        assert jax.tree.structure(alone) == jax.tree.structure(whole[i]), stage.name
        assert all(np.array_equal(a, w) for a, w in zip(jax.tree.leaves(alone), jax.tree.leaves(whole[i]))), stage.name


def test_param_count_matches_the_real_leaves():
    leaves = jax.tree_util.tree_leaves_with_path(t5.abstract_params(CFG)[1])
    assert t5.param_count(CFG) == {
        "total": sum(int(np.prod(leaf.shape)) for _, leaf in leaves),
        "matmul": sum(int(np.prod(leaf.shape)) for path, leaf in leaves if path[-1].key == "kernel")}


def test_the_planning_estimates_count_this_familys_shapes():
    """`angel-jax plan --estimate` times each stage by the family's forward FLOPs (checked here against the real
    kernels: 2 per weight per position it multiplies, the cross-attention's k and v at the encoder's positions), and
    the device estimate counts both carried streams in every saved stage input."""
    cfg = Config(model=CFG, train=TrainConfig(batch_size=B))
    c = t5.corruption(CFG)
    enc, dec, d = c.encoder_length, c.decoder_length, CFG.d_model
    _, params = t5.abstract_params(CFG)

    def matmul_flops(tree: dict, positions) -> int:
        leaves = jax.tree_util.tree_leaves_with_path(tree)
        return sum(2 * positions(path) * int(np.prod(leaf.shape[1:])) for path, leaf in leaves
                   if path[-1].key == "kernel")

    encoder = matmul_flops(params["encoder"], lambda path: enc) + 4 * enc * enc * d
    cross_kv = {"k", "v"}
    decoder = (matmul_flops(params["decoder"], lambda path: enc if path[0].key == "cross_attn"
                            and path[1].key in cross_kv else dec) + 4 * dec * dec * d + 4 * dec * enc * d)
    costs = estimate_costs(cfg, blueprint(cfg), 1e12, 1e9, 1e9)
    assert costs[2].forward_s * 1e12 == pytest.approx(B * encoder, rel=1e-9)
    assert costs[5].forward_s * 1e12 == pytest.approx(B * decoder, rel=1e-9)
    assert costs[-1].backward_s * 1e12 == pytest.approx(3 * B * 2 * dec * d * c.table_size, rel=1e-9)
    assert saved_input_bytes(cfg, B) == B * 6 * (enc + dec) * d * 4  # 6 stages after the embedding


# ------------------------------------------------------------------------------------------------ training

# ------------------------------------------------------------------------------------ mixture of experts (T5-MoE)

MOE_MODEL = ModelConfig(name="t5", vocab_size=256, seq_len=24, d_model=64, n_layers=2, n_heads=2, mlp_hidden=64,
                        relative_buckets=8, relative_max_distance=16, compute_dtype="float32",
                        moe=MoEConfig(experts=4, top_k=2, capacity_factor=1.0, aux_loss_coef=0.1, z_loss_coef=0.01))


def test_moe_counts_every_expert_in_the_parameters_and_top_k_in_the_flops():
    cfg = dataclasses.replace(MOE_MODEL, moe=dataclasses.replace(MOE_MODEL.moe, every=2), n_decoder_layers=4)
    staged = models.get(cfg)
    assert [s.kind for s in staged.stages[1:-1]] == ["encoder", "encoder_moe", "encoder_norm", "decoder",
                                                    "decoder_moe", "decoder", "decoder_moe"]
    leaves = jax.tree_util.tree_leaves_with_path(staged.abstract()[1])
    matmul = ("kernel", "gate", "up", "down")
    assert staged.param_count["total"] == sum(int(np.prod(leaf.shape)) for _, leaf in leaves)
    assert staged.param_count["matmul"] == sum(int(np.prod(leaf.shape)) for path, leaf in leaves
                                               if path[-1].key in matmul)
    dense = models.get(dataclasses.replace(cfg, moe=MoEConfig()))
    d, h, e = cfg.d_model, cfg.hidden, cfg.moe.experts
    # three MoE MLPs (one encoder, two decoder blocks): each adds a router and e - 1 experts; a token uses top_k
    assert staged.param_count["total"] - dense.param_count["total"] == 3 * (d * e + (e - 1) * 3 * d * h)
    assert staged.param_count["active"] - dense.param_count["matmul"] == 3 * (d * e + 3 * d * h)
    c = t5.corruption(cfg)
    assert (staged.flops_per_token - dense.flops_per_token) * cfg.seq_len == pytest.approx(
        3 * 2 * (c.encoder_length + 2 * c.decoder_length) * (d * e + 3 * d * h), rel=1e-12)


@pytest.mark.compares_programs
def test_paged_training_with_streamed_stages_matches_the_reference():
    """T5 and T5-MoE in one model: every other encoder and decoder block routed (4 experts, top 2; capacity 1.0, so
    tokens drop), the others dense. The paged engine streams the stages, carries the encoder's output through the
    decoder stages (each stage's vjp adding its share of that output's gradient) and the auxiliary sums through the
    stage pytrees; its losses (with the auxiliary term), gradient norms and MoE figures equal the whole model's step
    by step, whose gradients come from differentiating the whole model at once. (One model for both: each costs
    the compilation of every stage kind. SGD: its update compiles fastest.)"""
    steps = 3
    model = dataclasses.replace(MOE_MODEL, moe=dataclasses.replace(MOE_MODEL.moe, every=2))
    assert {s.kind for s in models.get(model).stages} >= {"encoder", "encoder_moe", "decoder", "decoder_moe"}
    cfg = Config(model=model, optimizer=OptimizerConfig(name="sgd", lr=0.5, warmup_steps=0, grad_clip=0.5),
                 train=TrainConfig(steps=steps, batch_size=2),
                 memory=MemoryConfig(mode="paged", page_size=8 * 4096))
    cfg = dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, device_budget=state_bytes(cfg) * 9 // 10))
    data = batches(steps, model=model)
    staged = models.get(model)
    graphdef, _ = staged.abstract()
    params = moe_params(model)  # drawn with numpy: an eager init compiles a program per shape
    tx, schedule = make_optimizer(cfg.optimizer, steps)
    state, ref = init_state(params, tx), []
    step = compiled(make_train_step(graphdef, tx, schedule, staged.loss, staged.figures), state, data[0])
    for batch in data:
        state, m = step(state, batch)
        ref.append({k: float(v) for k, v in m.items()})
    engine = build_paged_runtime(cfg, params, data[0])
    try:
        assert len(engine.plan.streamed) >= 0.5 * len(engine.plan.home), engine.plan.home
        got = [{k: float(v) for k, v in engine.executor.step(b).items()} for b in data]
    finally:
        engine.close()
    assert ref[0]["moe/aux_loss"] > 0.1 and ref[0]["moe/drop_rate"] > 0, ref[0]
    assert ref[-1]["loss"] < ref[0]["loss"], ref
    for key in ("loss", "grad_norm", "moe/aux_loss", "moe/drop_rate"):
        np.testing.assert_allclose([m[key] for m in got], [m[key] for m in ref], rtol=1e-5, err_msg=key)
