"""angel_jax/optim/factory.py: the optimizer built from the config, and its state stored in a narrower dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from angel_jax.config import Config, ModelConfig, OptimizerConfig
from angel_jax.optim.factory import make_optimizer, stored_as
from angel_jax.train.engines import state_bytes


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
