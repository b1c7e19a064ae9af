"""The stage update on flat segments of the pages (optim/flat.py) against the leaf-wise one (optim/stage_update.py): the
same optax transformation, grouped into leaves or into segments cut at page ends, must give the same pages: to the
last bit where nothing is computed (a dropped update), within float32 rounding otherwise (XLA compiles the two
groupings into different loops, which may round an element's last bit differently)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from angel_jax.memory import PageLayout
from angel_jax.optim.factory import stored_as, with_lr_scale
from angel_jax.optim.flat import FlatPlan
from angel_jax.optim.stage_update import make_stage_update, split_opt_state

PAGE = 256  # bytes: 64 float32 elements, so leaves span pages and each moment family starts mid-page


def _tree(seed: int, scale: float = 1.0) -> dict:
    rng = np.random.default_rng(seed)
    shapes = {"w": (5, 7), "b": (9,), "w2": (3, 11), "s": (4,)}
    return {k: (rng.standard_normal(s) * scale).astype(np.float32) for k, s in shapes.items()}


def _setup(tx: optax.GradientTransformation, grads: dict, apart: tuple[str, ...] = (), dtype=np.float32):
    """`apart`: leaves on pages of their own (an MoE layer's experts), and their optimizer moments likewise;
    `dtype`: the parameters' (and gradients')."""
    params = {k: v.astype(dtype) for k, v in _tree(0).items()}
    grads = {k: v.astype(dtype) for k, v in grads.items()}
    keys = sorted(params)  # the leaves' order
    prep = PageLayout.build([("s", params)], PAGE, lambda _, path: path.strip("[']") in apart).stage("s")
    state = tx.init(params)
    state = jax.tree.map(lambda x: x + 0, state)
    # a state that is not all zeros: one update from other gradients first
    _, state = tx.update(_tree(2, 0.01), state, params)
    big, small, layout = split_opt_state(state)
    mirrors = {f"[{i}]" for i in range(len(big)) if keys[i % len(keys)] in apart}  # family by family
    orep = PageLayout.build([("s", [np.asarray(b) for b in big])], PAGE, lambda _, path: path in mirrors).stage("s")
    inputs = (prep.pack(params), prep.pack(grads), orep.pack([np.asarray(b) for b in big]),
              [jnp.asarray(s) for s in small])
    return prep, orep, layout, inputs


def _both(tx, grads, ok=True, norm=3.0, lr_scale=0.5, clip=1.0, apart=()):
    tx = with_lr_scale(tx)  # (the engines hand the guard's multiplier in, as make_optimizer's transformations take it)
    prep, orep, layout, (pp, gp, op, small) = _setup(tx, grads, apart)
    plan = FlatPlan.build(tx, prep, orep, layout.paged)
    assert plan is not None and len(plan.bounds) > 1  # several segments: page ends inside leaves (and families)
    args = (pp, gp, op, small, jnp.float32(norm), jnp.bool_(ok), jnp.float32(lr_scale))
    leafwise = jax.jit(make_stage_update(tx, prep, orep, layout, clip))(*args)
    flat = jax.jit(make_stage_update(tx, prep, orep, layout, clip, elementwise=True))(*args)
    for out in (leafwise, flat):  # pages are held as bits: both updates give bits, compared here as values
        assert all(p.dtype == s.bits for p, s in zip(out[0] + out[1], prep.pages + orep.pages))
    values = lambda out: (prep.values(out[0]), orep.values(out[1]), *out[2:])  # noqa: E731
    return values(leafwise), values(flat), (prep.values(pp), orep.values(op), small)


def _assert_same(leafwise, flat):
    (lp, lo, ls, lsq, la), (fp, fo, fs, fsq, fa) = leafwise, flat
    for a, b in zip(lp + lo, fp + fo, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_allclose(np.asarray(b, np.float32), np.asarray(a, np.float32), rtol=1e-6, atol=1e-9)
    for a, b in zip(ls, fs, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert bool(la) == bool(fa)
    np.testing.assert_allclose(float(fsq), float(lsq), rtol=1e-6)


ADAMW = optax.adamw(1e-2, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)


@pytest.mark.parametrize("tx", [ADAMW, stored_as(ADAMW, jnp.dtype(jnp.bfloat16)),
                                optax.sgd(1e-2, momentum=0.9), optax.lion(1e-3, weight_decay=0.1)],
                         ids=["adamw", "adamw-bf16-state", "sgd-momentum", "lion"])
def test_flat_update_equals_the_leafwise_one(tx):
    leafwise, flat, (pp, op, _) = _both(tx, _tree(1))
    _assert_same(leafwise, flat)
    assert bool(flat[4])
    assert not np.array_equal(np.asarray(flat[0][0]), np.asarray(pp[0]))  # it did update


def test_leaves_on_pages_of_their_own_update_flat_too():
    """Expert weights on pages of their own (and their moments): the flat range runs group by group."""
    leafwise, flat, (pp, _, _) = _both(ADAMW, _tree(1), apart=("w2", "b"))
    _assert_same(leafwise, flat)
    assert not np.array_equal(np.asarray(flat[0][-1]), np.asarray(pp[-1]))  # the apart pages did update


@pytest.mark.parametrize("ok, grad", [(False, 1.0), (True, np.inf)], ids=["guard-says-no", "not-finite"])
def test_a_dropped_update_leaves_every_page_as_it_was(ok, grad):
    grads = _tree(1)
    grads["b"][3] = grad
    leafwise, flat, (pp, op, small) = _both(ADAMW, grads, ok=ok, clip=0.0)
    _assert_same(leafwise, flat)
    assert not bool(flat[4])
    for a, b in zip(flat[0] + flat[1], pp + op, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(flat[2][0]), np.asarray(small[0]))


def test_no_flat_plan_where_the_optimizer_is_not_a_mirror_of_the_parameters():
    tx = optax.adafactor(1e-2, min_dim_size_to_factor=2)
    params = {"w": np.ones((64, 80), np.float32)}
    prep = PageLayout.build([("s", params)], PAGE).stage("s")
    big, _, layout = split_opt_state(tx.init(params))
    orep = PageLayout.build([("s", [np.asarray(b) for b in big])], PAGE).stage("s")
    assert FlatPlan.build(tx, prep, orep, layout.paged) is None
