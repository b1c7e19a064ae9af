"""The reference training step: a pure function of (state, batch), jitted once.

This is the arithmetic every other engine in angel_jax is measured against: the paged engine must reproduce its
losses, checkpoints must resume it bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from models.gpt import cross_entropy


@jax.tree_util.register_dataclass
@dataclass
class TrainState:
    step: jax.Array
    """Number of optimizer steps taken (int32 scalar)."""
    params: Any
    """Model parameters, a nested dict of arrays."""
    opt_state: Any
    """The optax state."""


def init_state(params: Any, tx: optax.GradientTransformation) -> TrainState:
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation,
                    schedule: optax.Schedule) -> Callable[[TrainState, jax.Array], tuple[TrainState, dict]]:
    """step(state, batch[int32, B x (T+1)]) -> (new state, metrics). The gradient norm is the one before clipping."""

    def loss_fn(params: Any, batch: jax.Array) -> jax.Array:
        logits = nnx.merge(graphdef, params)(batch[:, :-1])
        return cross_entropy(logits, batch[:, 1:])

    def step(state: TrainState, batch: jax.Array) -> tuple[TrainState, dict]:
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            "loss": loss,
            "grad_norm": optax.global_norm(grads),
            "update_norm": optax.global_norm(updates),
            "lr": schedule(state.step),
        }
        return TrainState(state.step + 1, params, opt_state), metrics

    return step
