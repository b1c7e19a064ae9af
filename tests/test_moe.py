"""Mixture-of-experts MLPs (model.moe): routing with capacity, the auxiliary losses, the layer against the dense
mixture it approximates, the stage view against the whole model, and the paged engine against the reference."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from angel_jax.config import (Config, ConfigError, MemoryConfig, ModelConfig, MoEConfig, OptimizerConfig,
                              TrainConfig, config_from_dict)
from angel_jax.optim import make_optimizer
from angel_jax.schedule.runtime import build_paged_runtime
from angel_jax.train.step import init_state, make_train_step
import models
from models.moe import MoE, capacity, route
from test_paged import batches

# Four experts of which each token takes two, with slots for fewer routings than an uneven router sends.
TINY = ModelConfig(d_model=32, n_layers=2, n_heads=2, seq_len=16, compute_dtype="float32",
                   moe=MoEConfig(experts=4, top_k=2, capacity_factor=1.0))


# Jitted: op by op, the CPU backend compiles every primitive on its own (seconds for a layer).
route = jax.jit(route, static_argnames=("top_k", "slots"))
call = nnx.jit(lambda layer, x: layer(x))


def run_once(fn: Callable, *args: Any) -> Any:
    """fn(*args) jitted, compiled without XLA's backend optimisations: the same arithmetic (to float rounding),
    compiled in about half the time, for the larger programs of the tests below."""
    return compiled(fn, *args)(*args)


def compiled(fn: Callable, *args: Any) -> Callable:
    return jax.jit(fn).lower(*args).compile(compiler_options={"xla_backend_optimization_level": 0})


def _layer(experts: int, top_k: int, factor: float, d: int = 8, gated: bool = False, std: float = 0.5) -> MoE:
    """An MoE layer with weights normal(std) drawn by numpy (its initialisers would compile op by op)."""
    cfg = ModelConfig(d_model=d, mlp_ratio=2.0, compute_dtype="float32",
                      moe=MoEConfig(experts=experts, top_k=top_k, capacity_factor=factor))
    graphdef, state = nnx.split(nnx.eval_shape(lambda: MoE(cfg, gated=gated, out_std=std, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(experts)
    return nnx.merge(graphdef, jax.tree.map(lambda a: jnp.asarray(rng.normal(0, std, a.shape), a.dtype), state))


# ------------------------------------------------------------------------------------------------ the layer


def test_capacity_drops_the_routings_past_an_experts_slots():
    """Three tokens prefer expert 0, which has two slots: the third is dropped (its output is 0), the fourth goes
    to expert 1. The router is set by hand: logits = x @ kernel."""
    assert capacity(4, 2, 1, 1.0) == 2
    layer = _layer(experts=2, top_k=1, factor=1.0, d=2)
    layer.router.kernel[...] = jnp.eye(2)
    x = jnp.array([[[3.0, 0.0], [2.0, 0.0], [1.0, 0.0], [0.0, 1.0]]])
    routing = route(x @ layer.router.kernel[...], top_k=1, slots=2)
    np.testing.assert_array_equal(routing.dispatch[0], np.array([
        [[1, 0], [0, 0]],  # token 0: expert 0, slot 0
        [[0, 1], [0, 0]],  # token 1: expert 0, slot 1
        [[0, 0], [0, 0]],  # token 2: expert 0 is full
        [[0, 0], [1, 0]],  # token 3: expert 1, slot 0
    ]))
    np.testing.assert_allclose(routing.drop_rate, [0.25])
    y, figures = call(layer, x)
    np.testing.assert_array_equal(y[0, 2], 0.0)
    assert np.all(np.abs(y[0, [0, 1, 3]]) > 0)
    np.testing.assert_allclose(figures.drop_rate, [0.25])


def test_every_tokens_first_choice_takes_a_slot_before_any_second_choice():
    """Token 0 prefers expert 0 then 1, token 1 expert 1 then 0, one slot each: both first choices are kept and
    both second choices dropped (in token order instead, token 1 would lose both of its experts)."""
    logits = jnp.log(jnp.array([[[0.7, 0.3], [0.2, 0.8]]]))
    routing = route(logits, top_k=2, slots=1)
    np.testing.assert_array_equal(routing.dispatch[0, :, :, 0], [[1, 0], [0, 1]])
    np.testing.assert_allclose(routing.combine[0, :, :, 0], [[0.7, 0], [0, 0.8]], rtol=1e-6)
    np.testing.assert_allclose(routing.drop_rate, [0.5])


def test_auxiliary_losses_follow_their_formulas():
    """Load balance E * sum_e f_e p_e over top-2 routings, and the router z-loss, on 3 tokens by hand."""
    logits = np.array([[[2.0, 1.0, 0.0], [0.0, 3.0, 1.0], [1.0, 1.5, 2.0]]], np.float32)
    routing = route(jnp.asarray(logits), top_k=2, slots=3)
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    top2 = [[0, 1], [1, 2], [2, 1]]  # each token's two largest logits
    f = np.zeros(3)
    for experts in top2:
        f[experts] += 1 / 6
    np.testing.assert_allclose(routing.balance, [3 * np.sum(f * probs[0].mean(0))], rtol=1e-6)
    lse = np.log(np.exp(logits[0]).sum(-1))
    np.testing.assert_allclose(routing.z_loss, [np.mean(lse ** 2)], rtol=1e-6)
    np.testing.assert_allclose(routing.drop_rate, [0.0])


@pytest.mark.compares_programs
@pytest.mark.parametrize("gated", [False, True])
def test_all_experts_with_room_for_every_token_is_the_dense_mixture(gated):
    """top_k = experts and capacity for every token: sum_e softmax(router)_e * expert_e(x), computed expert by expert
    without dispatch masks."""
    layer = _layer(experts=3, top_k=3, factor=1.0, gated=gated)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 5, 8)), jnp.float32)
    y, figures = call(layer, x)

    @nnx.jit
    def mixture(layer: MoE, x: jax.Array) -> jax.Array:
        probs = jax.nn.softmax(x @ layer.router.kernel[...], axis=-1)
        want = 0
        for e in range(3):
            if gated:
                out = (jax.nn.silu(x @ layer.gate[e]) * (x @ layer.up[e])) @ layer.down[e]
            else:
                out = jax.nn.gelu(x @ layer.w_in[e]) @ layer.w_out[e]
            want = want + probs[..., e:e + 1] * out
        return want

    np.testing.assert_allclose(y, mixture(layer, x), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(figures.drop_rate, [0.0, 0.0])


def test_moe_keys_are_checked_by_name():
    def load(**moe):
        return config_from_dict({"model": {"n_layers": 4, "moe": moe}})

    assert load().model.moe.experts == 0
    with pytest.raises(ConfigError, match="'model.moe.top_k'"):
        load(experts=2, top_k=3)
    with pytest.raises(ConfigError, match="'model.moe.every'.*not a multiple"):
        load(experts=2, top_k=1, every=3)
    with pytest.raises(ConfigError, match="'model.moe.capacity_factor'"):
        load(experts=2, capacity_factor=0)
    with pytest.raises(ConfigError, match="unknown key 'model.moe.expert'"):
        load(expert=2)


# ----------------------------------------------------------------------------------------------- the model


def _params(cfg: ModelConfig) -> dict:
    """Parameters drawn with numpy in the model's shapes, nothing compiled: normal(0.02), norms' scales 1."""
    _, abstract = models.get(cfg).abstract()
    rng = np.random.default_rng(0)

    def draw(path: tuple, leaf: jax.ShapeDtypeStruct) -> np.ndarray:
        if path[-1].key in ("scale", "bias"):
            return np.full(leaf.shape, float(path[-1].key == "scale"), leaf.dtype)
        return rng.normal(0, 0.02, leaf.shape).astype(leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, abstract)


@pytest.mark.compares_programs
def test_stages_in_sequence_give_the_whole_models_loss_and_figures():
    """The whole model (a Llama whose second block has an MoE MLP: both kinds of block and both stacks, one
    scanned group) against its stages run in sequence (the GPT's stages against its whole model: the paged test
    below); an MoE block stage initialised alone is the whole model's."""
    cfg = dataclasses.replace(TINY, name="llama", moe=dataclasses.replace(TINY.moe, every=2))
    staged = models.get(cfg)
    graphdef, _ = staged.abstract()
    assert [s.kind for s in staged.stages] == ["embed", "block", "moe_block", "head"]
    params, tokens = _params(cfg), batches(1, cfg, 4)[0]

    def loss_and_figures(out: object) -> tuple:
        return staged.loss(out, tokens[:, 1:]), staged.figures(out)

    whole = run_once(lambda p: loss_and_figures(nnx.merge(graphdef, p)(tokens[:, :-1])), params)
    stages = run_once(lambda parts: loss_and_figures(staged.forward(parts, tokens[:, :-1])), staged.split(params))
    assert float(stages[0]) == pytest.approx(float(whole[0]), rel=1e-6)
    assert float(whole[1]["moe/aux_loss"]) > 0  # the auxiliary losses are part of the loss
    for key, value in whole[1].items():
        assert float(stages[1][key]) == pytest.approx(float(value), rel=1e-5, abs=1e-7), key
    split, alone = run_once(lambda: (staged.split(staged.init(0)[1])[2], staged.init_stage(0, 2)))
    assert jax.tree.all(jax.tree.map(np.array_equal, split, alone))


def test_parameter_and_flop_counts_count_all_experts_and_the_routed_ones():
    staged = models.get(TINY)
    _, abstract = staged.abstract()
    assert staged.param_count["total"] == sum(a.size for a in jax.tree.leaves(abstract))
    dense = models.get(dataclasses.replace(TINY, moe=MoEConfig()))
    expert = 2 * TINY.d_model * TINY.hidden
    # Each of the two blocks: 4 experts and a router in place of a dense MLP (of one expert's size, with biases),
    # of which a token uses 2 experts.
    assert staged.param_count["total"] - dense.param_count["total"] == \
        2 * (3 * expert + TINY.d_model * 4 - TINY.hidden - TINY.d_model)
    assert staged.param_count["active"] == dense.param_count["matmul"] + 2 * (expert + TINY.d_model * 4)
    assert staged.flops_per_token - dense.flops_per_token == 6 * 2 * (expert + TINY.d_model * 4)


# ------------------------------------------------------------------------------------------------- training

STEPS, BATCH = 4, 4


def _cfg(**memory) -> Config:
    # SGD: its update compiles in a fraction of Adam's time; clipped, so a gradient off by a factor shows.
    return Config(model=TINY, optimizer=OptimizerConfig(name="sgd", lr=0.5, warmup_steps=1, grad_clip=0.5),
                  train=TrainConfig(steps=STEPS, batch_size=BATCH, micro_batch_size=memory.pop("micro", 0)),
                  memory=MemoryConfig(mode="paged", page_size=8 * 4096, **memory))


def _reference() -> tuple[list[dict], dict]:
    """The reference step on the whole batch: its metrics with the MoE figures; the initial parameters (numpy)."""
    cfg = _cfg()
    staged = models.get(cfg.model)
    graphdef, _ = staged.abstract()
    params = _params(cfg.model)
    tx, schedule = make_optimizer(cfg.optimizer, cfg.train.steps)
    state, out, data = init_state(params, tx), [], batches(STEPS, TINY, BATCH)
    step = compiled(make_train_step(graphdef, tx, schedule, staged.loss, staged.figures), state, data[0])
    for b in data:
        state, m = step(state, b)
        out.append({k: float(v) for k, v in m.items()})
    return out, params


@pytest.mark.compares_programs
def test_paged_engine_with_streamed_stages_matches_the_reference():
    """Stages streamed through a small device budget, in two micro-batches (scanned calls over pytree
    activations): the losses and MoE figures of the whole-batch reference (routing is per sequence, so
    micro-batches route as the whole batch)."""
    ref, params = _reference()
    cfg = _cfg(device_budget=1_000_000, micro=2)
    data = batches(STEPS, TINY, BATCH)
    engine = build_paged_runtime(cfg, params, data[0])
    try:
        assert len(engine.plan.streamed) >= 2, engine.plan.home
        got = [{k: float(v) for k, v in engine.executor.step(b).items()} for b in data]
    finally:
        engine.close()
    assert ref[-1]["loss"] < ref[0]["loss"]
    assert ref[0]["moe/drop_rate"] > 0
    for key in ("loss", "moe/aux_loss", "moe/drop_rate"):
        np.testing.assert_allclose([m[key] for m in got], [m[key] for m in ref], rtol=1e-5, err_msg=key)
