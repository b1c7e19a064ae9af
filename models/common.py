"""Pieces every model family shares: the per-stage random keys, the loss, and the pure-dict view of NNX state."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx


def stage_key(key: jax.Array, stage: int | jax.Array) -> jax.Array:
    """The key stage `stage` draws its parameters from (0 = embed, 1 + j = block j, n_layers + 1 = head): a stage
    is initialised from its own key alone, so it can be created without the rest of the model."""
    return jax.random.fold_in(key, stage)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in float32."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


def pure_dict(state: nnx.State) -> dict[str, Any]:
    """The state as nested dicts of arrays. Newer flax deprecates State.to_pure_dict for the module-level
    nnx.to_pure_dict; older 0.12 releases lack it."""
    to_pure = getattr(nnx, "to_pure_dict", None)
    return to_pure(state) if to_pure is not None else state.to_pure_dict()
