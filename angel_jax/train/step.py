"""The reference training step: a pure function of (state, batch, controls), jitted once.

This is the arithmetic every other engine in angel_jax is measured against: the paged engine must reproduce its
losses, checkpoints must resume it bit for bit.

`StepControls` are per-step scalars from the host: the update guard's bounds and a learning-rate multiplier
(angel_jax/optim/guard.py, the one guard every engine uses). The loss is the model's (`StagedModel.loss`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from angel_jax.optim.guard import StepControls, update_ok


@jax.tree_util.register_dataclass
@dataclass
class TrainState:
    step: jax.Array
    """Number of optimizer updates applied (int32 scalar; a skipped update does not count)."""
    params: Any
    """Model parameters, a nested dict of arrays."""
    opt_state: Any
    """The optax state."""


def init_state(params: Any, tx: optax.GradientTransformation) -> TrainState:
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, schedule: optax.Schedule,
                    loss: Callable[[jax.Array, jax.Array], jax.Array]) -> Callable[..., tuple[TrainState, dict]]:
    """step(state, batch[int32, B x (T+1)], controls=None) -> (new state, metrics). The gradient norm is the one
    before clipping; metrics["skipped"] is 1.0 when the guard dropped the update (a non-finite loss or norm is
    always dropped; without controls there are no other bounds)."""

    def loss_fn(params: Any, batch: jax.Array) -> jax.Array:
        logits = nnx.merge(graphdef, params)(batch[:, :-1])
        return loss(logits, batch[:, 1:])

    def step(state: TrainState, batch: jax.Array, controls: StepControls | None = None) -> tuple[TrainState, dict]:
        if controls is None:
            controls = StepControls().as_arrays()
        value, grads = jax.value_and_grad(loss_fn)(state.params, batch)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        updates = jax.tree.map(lambda u: u * controls.lr_scale.astype(u.dtype), updates)
        params = optax.apply_updates(state.params, updates)
        grad_norm, update_norm = optax.tree.norm(grads), optax.tree.norm(updates)
        ok = update_ok(value, grad_norm, update_norm, controls)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)  # noqa: E731
        new_state = TrainState(state.step + ok.astype(jnp.int32), keep(params, state.params),
                               keep(opt_state, state.opt_state))
        metrics = {
            "loss": value,
            "grad_norm": grad_norm,
            "update_norm": update_norm,
            "lr": schedule(state.step) * controls.lr_scale,
            "skipped": 1.0 - ok.astype(jnp.float32),
        }
        return new_state, metrics

    return step
