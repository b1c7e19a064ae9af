"""angel_jax/optim/factory.py: the optimizer built from the config, and its state stored in a narrower dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from angel_jax.config import Config, ConfigError, ModelConfig, OptimizerConfig, config_from_dict
from angel_jax.optim.factory import make_optimizer, stored_as, with_master_weights
from angel_jax.train.engines import state_bytes
import models


def _params():
    rng = np.random.default_rng(0)
    return {"w": jnp.asarray(rng.normal(size=(64, 32)), jnp.float32), "b": jnp.zeros((32,), jnp.float32)}


def test_state_is_stored_in_bfloat16_and_the_update_is_the_inner_one_in_float32():
    inner = optax.adamw(1e-2, b1=0.9, b2=0.95)
    tx = stored_as(inner, jnp.dtype(jnp.bfloat16))
    params = _params()
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.3) + p * 0.1, params)
    state = tx.init(params)
    leaves = jax.tree.leaves(state)
    assert {str(a.dtype) for a in leaves if jnp.issubdtype(a.dtype, jnp.floating)} == {"bfloat16"}
    assert any(a.dtype == jnp.int32 for a in leaves)  # the step count stays an integer
    for _ in range(3):
        widened = jax.tree.map(lambda a: a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a,
                               state)
        want_updates, want_state = inner.update(grads, widened, params)
        updates, state = tx.update(grads, state, params)
        for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(want_updates)):
            np.testing.assert_array_equal(a, b)  # computed in float32 from the stored state, exactly
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(want_state)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(a.dtype)))  # rounded to nearest
        params = optax.apply_updates(params, updates)


def test_the_config_picks_the_state_dtype_and_the_memory_estimate_follows():
    cfg = Config(model=ModelConfig(d_model=64, n_layers=2, n_heads=2, seq_len=16))
    narrow = Config(model=cfg.model, optimizer=OptimizerConfig(state_dtype="bfloat16"))
    tx, _ = make_optimizer(narrow.optimizer, 10)
    state = tx.init(_params())
    assert {str(a.dtype) for a in jax.tree.leaves(state) if a.ndim} == {"bfloat16"}
    # fp32 parameters and gradients, Adam's two buffers: 16 B per parameter in float32 state, 12 B in bfloat16.
    assert state_bytes(narrow) * 16 == state_bytes(cfg) * 12


def test_master_weights_update_a_float32_copy_and_the_parameters_are_its_rounding():
    """optimizer.master_weights: with bfloat16 parameters the optimizer runs on a float32 master (its state), so
    the master follows the float32 optimizer exactly on the same gradients, and the parameters are the master
    rounded, step after step (the small updates bfloat16 would round away accumulate in the master)."""
    inner = optax.adamw(1e-3, b1=0.9, b2=0.95, weight_decay=0.1)
    tx = with_master_weights(inner)
    master = _params()
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), master)
    master = jax.tree.map(lambda p: p.astype(jnp.float32), params)  # the master starts as the stored parameters
    state, want_state = tx.init(params), inner.init(master)
    assert {str(a.dtype) for a in jax.tree.leaves(state) if a.ndim} == {"float32"}
    for k in range(5):
        grads = jax.tree.map(lambda p: (jnp.sin(p.astype(jnp.float32) * (k + 1)) * 0.3).astype(jnp.bfloat16), params)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        want, want_state = inner.update(jax.tree.map(lambda g: g.astype(jnp.float32), grads), want_state, master)
        master = optax.apply_updates(master, want)
        for a, b in zip(jax.tree.leaves(state.master), jax.tree.leaves(master)):
            np.testing.assert_array_equal(a, b)
        for p, m in zip(jax.tree.leaves(params), jax.tree.leaves(master)):
            assert p.dtype == jnp.bfloat16
            np.testing.assert_array_equal(np.asarray(p), np.asarray(m.astype(jnp.bfloat16)))
    # Without the master the same steps round away: lr 1e-3 moves a weight of ~1 by less than half a bfloat16 ulp.
    plain = params0 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), _params())
    plain_state = inner.init(plain)
    for k in range(5):
        grads = jax.tree.map(lambda p: (jnp.sin(p.astype(jnp.float32) * (k + 1)) * 0.3).astype(jnp.bfloat16), plain)
        u, plain_state = inner.update(grads, plain_state, plain)
        plain = optax.apply_updates(plain, u)
    stuck = np.mean([np.mean(np.asarray(a) == np.asarray(b)) for a, b in zip(jax.tree.leaves(plain),
                                                                               jax.tree.leaves(params0))])
    moved = np.mean([np.mean(np.asarray(a) == np.asarray(b)) for a, b in zip(jax.tree.leaves(params),
                                                                               jax.tree.leaves(params0))])
    assert stuck > moved, (stuck, moved)


def test_master_weights_need_narrow_parameters_and_count_in_the_state_bytes():
    with pytest.raises(ConfigError, match="optimizer.master_weights.*param_dtype=bfloat16"):
        config_from_dict({"optimizer": {"master_weights": True}})
    model = ModelConfig(d_model=64, n_layers=2, n_heads=2, seq_len=16, param_dtype="bfloat16")
    plain = Config(model=model)
    mixed = Config(model=model, optimizer=OptimizerConfig(master_weights=True))
    n = models.get(model).param_count["total"]
    assert state_bytes(mixed) - state_bytes(plain) == 4 * n
    tx, _ = make_optimizer(mixed.optimizer, 10)
    state = tx.init(jax.tree.map(lambda p: p.astype(jnp.bfloat16), _params()))
    assert sorted({str(a.dtype) for a in jax.tree.leaves(state) if a.ndim}) == ["float32"]


def test_the_guards_lr_scale_scales_the_step_the_parameters_and_the_master_take():
    """Engines hand the anomaly guard's learning-rate multiplier to `tx.update` (`with_lr_scale`): the updates are
    scaled, and with master weights it is the master's step that is scaled, so master and parameters agree."""
    for master in (False, True):
        cfg = OptimizerConfig(lr=1e-2, warmup_steps=0, master_weights=master)
        tx, _ = make_optimizer(cfg, 10)
        params = jax.tree.map(lambda p: p.astype(jnp.bfloat16 if master else jnp.float32), _params())
        grads = jax.tree.map(lambda p: jnp.cos(p.astype(jnp.float32)).astype(p.dtype), params)
        state = tx.init(params)
        full, full_state = tx.update(grads, state, params)
        half, half_state = tx.update(grads, state, params, lr_scale=jnp.float32(0.5))
        if not master:
            for a, b in zip(jax.tree.leaves(half), jax.tree.leaves(full)):
                np.testing.assert_array_equal(a, b * 0.5)
            continue
        master_of = lambda st: st[1].master  # noqa: E731 - (clipping's state, then the master's)
        for h, f, m0 in zip(*(jax.tree.leaves(master_of(st)) for st in (half_state, full_state, state))):
            np.testing.assert_allclose(h - m0, (f - m0) * 0.5, atol=5e-7)  # (each sum rounded once)
        new = optax.apply_updates(params, half)
        for p, m in zip(jax.tree.leaves(new), jax.tree.leaves(master_of(half_state))):
            np.testing.assert_array_equal(np.asarray(p), np.asarray(m.astype(jnp.bfloat16)))
