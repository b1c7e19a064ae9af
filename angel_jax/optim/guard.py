"""The update guard, one definition for every engine: an update whose loss, gradient norm or update norm is
non-finite or above its bound is dropped on the device, so a bad batch never reaches the parameters even though
the host reads the metrics a step late.

`StepControls` are the per-step scalars from the host (the bounds and a learning-rate multiplier). Their defaults
(no bound, multiplier 1) leave the arithmetic exactly that of the unguarded step: x * 1.0 == x, and selecting
the updated state changes no value. The in-memory step judges all three figures at once (`update_ok`); the paged
engine knows the loss and gradient norm first (`before_update_ok`) and the update norm only after a pass over
every stage (`update_norm_ok`); `update_ok` is by definition the conjunction of the two, so they cannot disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


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


def _within(figure: jax.Array, bound: jax.Array | float) -> jax.Array:
    return jnp.isfinite(figure) & (figure <= jnp.asarray(bound, jnp.float32))


def before_update_ok(loss: jax.Array, grad_norm: jax.Array, controls: StepControls) -> jax.Array:
    """The part of the verdict known before any update is computed: loss and gradient norm."""
    return _within(loss, controls.max_loss) & _within(grad_norm, controls.max_grad_norm)


def update_norm_ok(update_norm: jax.Array, controls: StepControls) -> jax.Array:
    """The part that needs the update: its norm."""
    return _within(update_norm, controls.max_update_norm)


def update_ok(loss: jax.Array, grad_norm: jax.Array, update_norm: jax.Array, controls: StepControls) -> jax.Array:
    """Whether an update may be applied: every figure finite and within its bound."""
    return before_update_ok(loss, grad_norm, controls) & update_norm_ok(update_norm, controls)
