"""Stage-by-stage initialisation (`StagedModel.init_stage`) against the whole model's (`init` + `split`).

The whole model creates its blocks in one vmapped construction over the per-block keys; `init_stage` builds one
module alone from its own key. The two must agree bit for bit, and `init_stage` must never build more than its stage
(the paged engine initialises models larger than host RAM that way).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from angel_jax.config import ModelConfig
from models import gpt

CFG = ModelConfig(vocab_size=256, seq_len=32, d_model=32, n_layers=3, n_heads=2, compute_dtype="float32")
BF16 = dataclasses.replace(CFG, compute_dtype="bfloat16", param_dtype="bfloat16")


def _assert_bit_identical(got, want, where: str) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want), where
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        name = where + jax.tree_util.keystr(path)
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, w.dtype, g.shape, w.shape)
        assert np.array_equal(np.asarray(g), np.asarray(w)), name


@pytest.mark.parametrize("cfg", [CFG, BF16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("seed", [0, 12345])
def test_every_stage_equals_the_whole_model_split_bit_for_bit(cfg, seed):
    staged = gpt.staged(cfg)
    whole = staged.split(staged.init(seed)[1])
    assert len(whole) == len(staged.stages) == cfg.n_layers + 2
    for i, stage in enumerate(staged.stages):
        _assert_bit_identical(staged.init_stage(seed, i), whole[i], f"seed {seed} {stage.name}")


def _random_leaves(params) -> dict[str, np.ndarray]:
    """The leaves drawn at random (LayerNorm scales and biases are constants)."""
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(params)
            if path[-1].key in ("kernel", "embedding", "positions")}


def test_seeds_and_stages_draw_different_values():
    staged = gpt.staged(CFG)
    for i in range(len(staged.stages)):
        a, b = _random_leaves(staged.init_stage(0, i)), _random_leaves(staged.init_stage(1, i))
        assert a and all(not np.array_equal(a[k], b[k]) for k in a), i
    blocks = [_random_leaves(staged.init_stage(0, 1 + j)) for j in range(CFG.n_layers)]
    for j in range(1, CFG.n_layers):  # every block has its own key
        assert all(not np.array_equal(blocks[0][k], blocks[j][k]) for k in blocks[0]), j


def test_initial_distributions():
    """normal(0.02) everywhere, residual projections scaled by 1/sqrt(2 * n_layers), LayerNorms at 1 and 0."""
    cfg = dataclasses.replace(CFG, d_model=128, n_heads=4)
    staged = gpt.staged(cfg)
    embed, block, head = (staged.init_stage(0, i) for i in (0, 1, cfg.n_layers + 1))
    small = 0.02 / (2 * cfg.n_layers) ** 0.5
    for leaf, std in ((embed["tokens"]["embedding"], 0.02), (embed["positions"], 0.02), (block["qkv"]["kernel"], 0.02),
                      (block["mlp_in"]["kernel"], 0.02), (block["attn_out"]["kernel"], small),
                      (block["mlp_out"]["kernel"], small), (head["unembed"]["kernel"], 0.02)):
        x = np.asarray(leaf)
        assert abs(x.mean()) < 0.1 * std and x.std() == pytest.approx(std, rel=0.05)
    assert np.all(np.asarray(block["ln_attn"]["scale"]) == 1) and np.all(np.asarray(block["qkv"]["bias"]) == 0)
    assert np.all(np.asarray(head["ln"]["scale"]) == 1)


def test_stage_index_out_of_range():
    staged = gpt.staged(CFG)
    for bad in (-1, CFG.n_layers + 2):
        with pytest.raises(IndexError):
            staged.init_stage(0, bad)


# ------------------------------------------------------------------------------------ one stage at a time

DEEP = ModelConfig(vocab_size=64, seq_len=16, d_model=16, n_layers=2000, n_heads=2, compute_dtype="float32")


def _largest_value(jaxpr) -> int:
    """Elements in the largest value any equation of `jaxpr` (or of a jaxpr nested in it) produces."""
    largest = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            largest = max(largest, int(np.prod(getattr(var.aval, "shape", ()))))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                if hasattr(sub, "jaxpr") and hasattr(sub, "consts"):  # a ClosedJaxpr
                    largest = max(largest, _largest_value(sub.jaxpr))
                elif hasattr(sub, "eqns"):
                    largest = max(largest, _largest_value(sub))
    return largest


def test_init_stage_computes_nothing_larger_than_its_stage():
    """Traced, `init_stage` of a 2000-block model never produces a value larger than the stage's own parameters,
    while the whole model's init does (the stacked blocks): building the model and slicing would fail here."""
    staged = gpt.staged(DEEP)
    largest_stage = 0
    for i in (0, 1, 1000, DEEP.n_layers, DEEP.n_layers + 1):
        closed = jax.make_jaxpr(lambda i=i: staged.init_stage(7, i))()
        stage_elements = sum(int(np.prod(v.aval.shape)) for v in closed.jaxpr.outvars)
        assert _largest_value(closed.jaxpr) <= stage_elements, staged.stages[i].name
        largest_stage = max(largest_stage, stage_elements)
    whole = jax.make_jaxpr(lambda: staged.init(7)[1])()
    assert _largest_value(whole.jaxpr) >= DEEP.n_layers * DEEP.d_model * 4 * DEEP.d_model  # the stacked mlp_in
    assert _largest_value(whole.jaxpr) > 100 * largest_stage


def test_deep_model_stages_equal_the_stacked_blocks():
    """2000 blocks created by one vmapped construction: the ones init_stage builds alone are the same bits."""
    staged = gpt.staged(DEEP)
    params = staged.init(3)[1]
    _assert_bit_identical(staged.init_stage(3, 0), params["embed"], "embed")
    _assert_bit_identical(staged.init_stage(3, DEEP.n_layers + 1), params["head"], "head")
    for j in (0, 1, 999, DEEP.n_layers - 1):
        want = jax.tree.map(lambda a, j=j: a[j], params["blocks"])
        _assert_bit_identical(staged.init_stage(3, 1 + j), want, f"block.{j}")
