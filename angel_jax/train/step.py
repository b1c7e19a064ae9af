"""The reference training step: a pure function of (state, batch, controls), jitted once.

This is the arithmetic every other engine in angel_jax is measured against: the paged engine must reproduce its
losses, checkpoints must resume it bit for bit.

`StepControls` are per-step scalars from the host: the anomaly guard's bounds (an update whose loss, gradient
norm or update norm is non-finite or above its bound is dropped on the device, so a bad batch never reaches the
parameters even though the host reads metrics a step late) and a learning-rate multiplier. Their defaults (no
bound, multiplier 1) leave the arithmetic exactly that of the unguarded step: x * 1.0 == x, and selecting the
updated state changes no value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from models.gpt import cross_entropy


@jax.tree_util.register_dataclass
@dataclass
class TrainState:
    step: jax.Array
    """Number of optimizer updates applied (int32 scalar; a skipped update does not count)."""
    params: Any
    """Model parameters, a nested dict of arrays."""
    opt_state: Any
    """The optax state."""


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepControls:
    max_loss: jax.Array | float = math.inf
    """Drop the update when the loss exceeds this (inf = never)."""
    max_grad_norm: jax.Array | float = math.inf
    """Drop the update when the gradient norm (before clipping) exceeds this."""
    max_update_norm: jax.Array | float = math.inf
    """Drop the update when its norm exceeds this."""
    lr_scale: jax.Array | float = 1.0
    """Multiplies the update (for the optimizers here, the same as multiplying the learning rate)."""

    def as_arrays(self) -> "StepControls":
        """float32 scalars: one compiled step serves every value."""
        return StepControls(*(jnp.asarray(v, jnp.float32) for v in
                              (self.max_loss, self.max_grad_norm, self.max_update_norm, self.lr_scale)))

    def as_numpy(self) -> "StepControls":
        return StepControls(*(np.asarray(v, np.float32) for v in
                              (self.max_loss, self.max_grad_norm, self.max_update_norm, self.lr_scale)))


def init_state(params: Any, tx: optax.GradientTransformation) -> TrainState:
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


def update_ok(loss: jax.Array, grad_norm: jax.Array, update_norm: jax.Array, controls: StepControls) -> jax.Array:
    """Whether an update may be applied: every figure finite and within its bound."""
    figures = (loss, grad_norm, update_norm)
    finite = jnp.all(jnp.isfinite(jnp.stack(figures)))
    within = (loss <= controls.max_loss) & (grad_norm <= controls.max_grad_norm) \
        & (update_norm <= controls.max_update_norm)
    return finite & within


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, schedule: optax.Schedule
                    ) -> Callable[..., tuple[TrainState, dict]]:
    """step(state, batch[int32, B x (T+1)], controls=None) -> (new state, metrics). The gradient norm is the one
    before clipping; metrics["skipped"] is 1.0 when the guard dropped the update (a non-finite loss or norm is
    always dropped; without controls there are no other bounds)."""

    def loss_fn(params: Any, batch: jax.Array) -> jax.Array:
        logits = nnx.merge(graphdef, params)(batch[:, :-1])
        return cross_entropy(logits, batch[:, 1:])

    def step(state: TrainState, batch: jax.Array, controls: StepControls | None = None) -> tuple[TrainState, dict]:
        if controls is None:
            controls = StepControls().as_arrays()
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        updates = jax.tree.map(lambda u: u * controls.lr_scale.astype(u.dtype), updates)
        params = optax.apply_updates(state.params, updates)
        grad_norm, update_norm = optax.tree.norm(grads), optax.tree.norm(updates)
        ok = update_ok(loss, grad_norm, update_norm, controls)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)  # noqa: E731
        new_state = TrainState(state.step + ok.astype(jnp.int32), keep(params, state.params),
                               keep(opt_state, state.opt_state))
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "update_norm": update_norm,
            "lr": schedule(state.step) * controls.lr_scale,
            "skipped": 1.0 - ok.astype(jnp.float32),
        }
        return new_state, metrics

    return step
