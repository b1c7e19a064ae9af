"""models/gpt.py and the stage view (models/stages.py) on a tiny float32 GPT."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from angel_jax.config import ModelConfig
from models import gpt

CFG = ModelConfig(vocab_size=256, seq_len=32, d_model=32, n_layers=2, n_heads=2, compute_dtype="float32")
B = 4


@pytest.fixture(scope="module")
def model():
    graphdef, params = gpt.init(CFG, seed=0)
    tokens = jax.random.randint(jax.random.key(1), (B, CFG.seq_len + 1), 0, CFG.vocab_size, dtype=jnp.int32)
    return graphdef, params, tokens


_JITTED: dict = {}


def _forward(cfg: ModelConfig):
    """Jitted whole-model forward for `cfg`'s graph (params are passed in, so variants share the same weights)."""
    key = ("forward", repr(cfg))
    if key not in _JITTED:  # compile each variant once per session
        graphdef, _ = gpt.abstract_params(cfg)
        _JITTED[key] = jax.jit(lambda params, tokens: nnx.merge(graphdef, params)(tokens))
    return _JITTED[key]


def _loss(cfg: ModelConfig):
    graphdef, _ = gpt.abstract_params(cfg)

    def loss(params, batch):
        return gpt.cross_entropy(nnx.merge(graphdef, params)(batch[:, :-1]), batch[:, 1:])

    return jax.jit(jax.value_and_grad(loss))


def _assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol,
                                   err_msg=jax.tree_util.keystr(path))


# ----------------------------------------------------------------------------------------- shapes, counts


def test_logits_shape_and_dtype(model):
    _, params, tokens = model
    logits = _forward(CFG)(params, tokens[:, :-1])
    assert logits.shape == (B, CFG.seq_len, CFG.vocab_size) and logits.dtype == jnp.float32
    assert np.isfinite(np.asarray(logits)).all()
    short = _forward(CFG)(params, tokens[:2, :7])  # shorter than seq_len: positions are sliced
    assert short.shape == (2, 7, CFG.vocab_size)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(params))


def test_bf16_compute_and_params_still_give_float32_logits(model):
    _, params, tokens = model
    cfg = dataclasses.replace(CFG, compute_dtype="bfloat16", param_dtype="bfloat16")
    abstract = gpt.abstract_params(cfg)[1]
    assert {leaf.dtype for leaf in jax.tree.leaves(abstract)} == {jnp.dtype(jnp.bfloat16)}
    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    logits = _forward(cfg)(bf16, tokens[:, :-1])
    assert logits.shape == (B, CFG.seq_len, CFG.vocab_size) and logits.dtype == jnp.float32
    # bf16 arithmetic: close to the float32 model, but not equal to it
    ref = np.asarray(_forward(CFG)(params, tokens[:, :-1]))
    assert 0 < np.abs(np.asarray(logits) - ref).max() < 0.1


def test_blocks_are_stacked_on_a_leading_layer_axis(model):
    _, params, _ = model
    for leaf in jax.tree.leaves(params["blocks"]):
        assert leaf.shape[0] == CFG.n_layers


def _count(params) -> dict[str, int]:
    leaves = jax.tree_util.tree_leaves_with_path(params)
    # matmul weights: every 'kernel' (blocks' linears and the unembedding); not the embedding lookup, norms, biases
    total = sum(int(np.prod(leaf.shape)) for _, leaf in leaves)
    matmul = sum(int(np.prod(leaf.shape)) for path, leaf in leaves if path[-1].key == "kernel")
    return {"total": total, "matmul": matmul, "active": matmul}  # dense: a token uses every weight


def test_param_count_matches_the_real_parameters(model):
    _, params, _ = model
    counts = _count(params)
    assert gpt.param_count(CFG) == counts
    assert gpt.flops_per_token(CFG) == 6 * counts["matmul"] + 12 * CFG.n_layers * CFG.d_model * CFG.seq_len


def test_param_count_matches_for_another_shape():
    cfg = dataclasses.replace(CFG, d_model=48, n_layers=2, n_heads=3, mlp_ratio=2.5, vocab_size=300, seq_len=20)
    counts = _count(gpt.abstract_params(cfg)[1])  # shapes only (eval_shape of the same constructor)
    assert gpt.param_count(cfg) == counts
    assert counts["total"] != gpt.param_count(CFG)["total"]


def test_init_is_deterministic_in_the_seed():
    a, b, c = gpt.init(CFG, 0)[1], gpt.init(CFG, 0)[1], gpt.init(CFG, 1)[1]
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    assert not np.array_equal(a["head"]["unembed"]["kernel"], c["head"]["unembed"]["kernel"])


def test_cross_entropy_matches_numpy(model):
    _, params, tokens = model
    logits = np.asarray(_forward(CFG)(params, tokens[:, :-1]), np.float64)
    targets = np.asarray(tokens[:, 1:])
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    want = -np.take_along_axis(logp, targets[..., None], -1).mean()
    got = float(gpt.cross_entropy(jnp.asarray(logits, jnp.float32), tokens[:, 1:]))
    assert got == pytest.approx(want, rel=1e-5)
    assert want == pytest.approx(np.log(CFG.vocab_size), rel=0.05)  # an untrained model is near uniform


# -------------------------------------------------------------------------------------------- the stages


def test_stage_names_and_kinds():
    staged = gpt.staged(CFG)
    assert [s.name for s in staged.stages] == ["embed"] + [f"block.{i}" for i in range(CFG.n_layers)] + ["head"]
    assert [s.kind for s in staged.stages] == ["embed"] + ["block"] * CFG.n_layers + ["head"]
    assert staged.kinds() == {"embed": [0], "block": list(range(1, CFG.n_layers + 1)), "head": [CFG.n_layers + 1]}
    assert set(staged.apply) == {"embed", "block", "head"}


def test_split_merge_round_trip_is_exact(model):
    _, params, _ = model
    staged = gpt.staged(CFG)
    parts = staged.split(params)
    assert len(parts) == len(staged.stages)
    # block i's parameters are leaf[i] of the stacked blocks
    for i in range(CFG.n_layers):
        np.testing.assert_array_equal(parts[1 + i]["qkv"]["kernel"], params["blocks"]["qkv"]["kernel"][i])
    merged = staged.merge(parts)
    assert jax.tree.structure(merged) == jax.tree.structure(params)
    for x, y in zip(jax.tree.leaves(merged), jax.tree.leaves(params)):
        assert x.shape == y.shape and x.dtype == y.dtype and np.array_equal(x, y)


@pytest.mark.compares_programs
def test_staged_forward_equals_whole_model(model):
    """Stage by stage (one jitted call per stage, blocks unrolled) vs the whole model with scanned blocks."""
    _, params, tokens = model
    assert CFG.scan_blocks
    whole = _forward(CFG)(params, tokens[:, :-1])
    staged = gpt.staged(CFG)
    parts = staged.split(params)
    x = tokens[:, :-1]
    apply = {kind: jax.jit(fn) for kind, fn in staged.apply.items()}  # one program per stage kind
    for stage, p in zip(staged.stages, parts):  # the stages really run one at a time
        x = apply[stage.kind](p, x)
        assert x.shape[:2] == (B, CFG.seq_len)
    np.testing.assert_allclose(np.asarray(x), np.asarray(whole), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(staged.forward(parts, tokens[:, :-1])), np.asarray(whole),
                               rtol=1e-5, atol=1e-5)
    loss_staged = staged.loss(staged.forward(parts, tokens[:, :-1]), tokens[:, 1:])
    loss_whole = gpt.cross_entropy(whole, tokens[:, 1:])
    assert float(loss_staged) == pytest.approx(float(loss_whole), rel=1e-6)


@pytest.mark.compares_programs
def test_staged_forward_with_remat_equals_whole_model(model):
    _, params, tokens = model
    cfg = dataclasses.replace(CFG, remat=True)
    staged = gpt.staged(cfg)
    got = jax.jit(staged.forward)(staged.split(params), tokens[:, :-1])
    np.testing.assert_allclose(np.asarray(got), np.asarray(_forward(CFG)(params, tokens[:, :-1])), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.compares_programs
@pytest.mark.parametrize("variant", [dict(scan_blocks=False), dict(remat=True)], ids=["unrolled", "remat"])
def test_block_execution_variants_give_the_same_logits(model, variant):
    _, params, tokens = model
    cfg = dataclasses.replace(CFG, **variant)
    np.testing.assert_allclose(np.asarray(_forward(cfg)(params, tokens[:, :-1])),
                               np.asarray(_forward(CFG)(params, tokens[:, :-1])), rtol=1e-5, atol=1e-5)


@pytest.mark.compares_programs
def test_remat_gives_the_same_gradients(model):
    """remat changes the backward pass (recomputation), so compare gradients, not only logits."""
    _, params, tokens = model
    loss_r, grads_r = _loss(dataclasses.replace(CFG, remat=True, scan_blocks=False))(params, tokens)
    loss_d, grads_d = _loss(CFG)(params, tokens)
    assert float(loss_r) == pytest.approx(float(loss_d), rel=1e-6)
    _assert_trees_close(grads_r, grads_d, rtol=1e-4, atol=1e-7)
    assert np.abs(np.asarray(grads_d["head"]["unembed"]["kernel"])).max() > 0


def test_causality(model):
    """Changing token t changes no logit before t, and does change the logits at and after t."""
    _, params, tokens = model
    fwd = _forward(CFG)
    x = tokens[:, :-1]
    t = 11
    y = x.at[:, t].set((x[:, t] + 17) % CFG.vocab_size)
    a, b = np.asarray(fwd(params, x)), np.asarray(fwd(params, y))
    np.testing.assert_allclose(b[:, :t], a[:, :t], rtol=0, atol=1e-6)
    assert np.abs(b[:, t:] - a[:, t:]).max(axis=-1).min() > 1e-4  # every later position sees the change
