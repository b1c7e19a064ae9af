"""Build the optax transformation and learning-rate schedule from the config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from angel_jax.config import OptimizerConfig


def make_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Linear warm-up to `lr` (step 0 already trains, at lr / warmup_steps), then cosine / linear decay to
    `lr * min_lr_ratio` (or constant)."""
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    decay_steps = max(total_steps - warmup, 1)
    final = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(cfg.lr, decay_steps, alpha=cfg.min_lr_ratio)
    elif cfg.schedule == "linear":
        after = optax.linear_schedule(cfg.lr, final, decay_steps)
    else:
        after = optax.constant_schedule(cfg.lr)
    if warmup == 0:
        return after
    ramp = optax.linear_schedule(cfg.lr / warmup, cfg.lr, warmup - 1)
    return optax.join_schedules([ramp, after], [warmup])


def make_optimizer(cfg: OptimizerConfig, total_steps: int, *,
                   clip: bool = True) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(transformation, schedule). Clipping by global norm comes first, as in every large-model recipe. The
    anomaly guard's learning-rate multiplier goes in as `tx.update(..., lr_scale=x)` (`with_lr_scale`).

    clip=False leaves clipping out: the paged engine applies the transformation per stage and clips with the
    norm over all stages itself (`clip_with_norm`)."""
    lr = make_schedule(cfg, total_steps)
    if cfg.name == "adamw":
        core = optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay)
    elif cfg.name == "adam":
        core = optax.adam(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)
    elif cfg.name == "lion":
        core = optax.lion(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay)
    elif cfg.name == "adafactor":
        core = optax.adafactor(lr)
    else:
        core = optax.sgd(lr, momentum=cfg.b1 or None)
    if cfg.state_dtype != "float32":
        core = stored_as(core, jnp.dtype(cfg.state_dtype))
    core = with_lr_scale(core)
    if cfg.master_weights:  # (outside stored_as: the master stays float32 whatever the moments are stored in)
        core = with_master_weights(core)
    if clip and cfg.grad_clip > 0:
        core = optax.chain(optax.clip_by_global_norm(cfg.grad_clip), core)
    return core, lr


STATE_BUFFERS = {"adamw": 2, "adam": 2, "lion": 1, "sgd": 1, "adafactor": 1}
"""Per optimizer, the parameter-sized buffers its state holds (of optimizer.state_dtype): Adam's two moments, one
momentum for Lion and SGD; an upper bound for Adafactor, whose factored moments take less."""


def state_buffers(cfg: OptimizerConfig) -> int:
    """Parameter-sized buffers `make_optimizer(cfg)` keeps per parameter (`STATE_BUFFERS`)."""
    return STATE_BUFFERS[cfg.name]


def is_elementwise(cfg: OptimizerConfig) -> bool:
    """Whether `make_optimizer(cfg)` updates every parameter element from that element alone (its gradient, its
    state, the step), never from a leaf's shape or its other elements: every optimizer here but Adafactor, which
    factors its second moment by rows and columns. Such an update may run on flat pages (optim/flat.py)."""
    return cfg.name != "adafactor"


@dataclass(frozen=True)
class SplitOptimizer:
    """`make_optimizer`'s transformation taken apart at the clipping, for a step that clips with a gradient norm
    it computed itself and applies the rest (`core`) separately. The whole transformation's state (what `tx.init`
    makes, what checkpoints hold) is optax.chain's `(clipping state, core state)` when `max_norm` > 0, the
    core's state otherwise; `core_state` and `with_core_state` read and replace the core's part."""

    tx: optax.GradientTransformation
    core: optax.GradientTransformation
    schedule: optax.Schedule
    max_norm: float
    """Clip by global norm to this (0 = no clipping)."""

    def core_state(self, opt_state: Any) -> Any:
        return opt_state[1] if self.max_norm > 0 else opt_state

    def with_core_state(self, opt_state: Any, core_state: Any) -> Any:
        return (opt_state[0], core_state) if self.max_norm > 0 else core_state


def split_optimizer(cfg: OptimizerConfig, total_steps: int) -> SplitOptimizer:
    tx, schedule = make_optimizer(cfg, total_steps)
    core, _ = make_optimizer(cfg, total_steps, clip=False)
    return SplitOptimizer(tx, core, schedule, max(cfg.grad_clip, 0.0))


def stored_as(inner: optax.GradientTransformation, dtype: jnp.dtype) -> optax.GradientTransformation:
    """`inner` with its floating-point state kept in `dtype` between steps (e.g. bfloat16: half the bytes of
    Adam's m and v) and computed in float32: each update widens the state, runs `inner` exactly, and rounds the
    new state to nearest. Integer leaves (step counts) are left alone. Works for any optax optimizer, and in the
    paged engine too: the state's pages simply have this dtype.

    Round-to-nearest is sound while each step's relative change of a state entry is above the dtype's precision
    (bfloat16: 2**-8): Adam's v moves by (1 - b2) = 5% per step at b2 = 0.95; with b2 = 0.999 small changes of v
    would round away."""

    def narrow(tree):
        return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)

    def init(params):
        return narrow(inner.init(params))

    def update(updates, state, params=None):
        updates, state = inner.update(updates, _float32(state), params)
        return updates, narrow(state)

    return optax.GradientTransformation(init, update)



def _float32(tree):
    """Floating-point leaves widened to float32 (integer leaves, step counts, as they are)."""
    return jax.tree.map(lambda a: a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def with_lr_scale(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """`inner`, its updates multiplied by the `lr_scale` extra argument of `update` (the anomaly guard's
    learning-rate multiplier; none: unscaled). Same state as `inner`. The engines hand the multiplier in rather
    than scale what comes out, so that `with_master_weights` scales the step its master takes."""

    def update(updates, state, params=None, *, lr_scale=None, **extra):
        updates, state = inner.update(updates, state, params)
        if lr_scale is not None:
            updates = jax.tree.map(lambda u: u * jnp.asarray(lr_scale).astype(u.dtype), updates)
        return updates, state

    return optax.GradientTransformationExtraArgs(inner.init, update)


class MasterState(NamedTuple):
    """`with_master_weights`' state: the float32 master parameters, then the inner optimizer's state."""

    master: Any
    inner: Any


def with_master_weights(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """`inner` run on a float32 master copy of parameters stored narrower (bfloat16): the state holds the master;
    each update widens the gradients, runs `inner` on the master (weight decay included), and returns float32
    updates that take the stored parameters to the new master's rounding (`optax.apply_updates` adds them in
    float32, then rounds to the parameters' dtype). The parameters are never the source of the next update, so
    rounding does not accumulate: the master carries what bfloat16 cannot hold. Extra arguments (`lr_scale`) go
    to `inner`: the master's step is the scaled one. The update norm an engine reports is that of these updates,
    the step from the stored parameters to the new master.

    The addition p + (master - p) is exact whenever p and the new master are within a factor of two (Sterbenz),
    the case of every ordinary step; elsewhere (a weight crossing zero) it is within a float32 rounding of the
    master, which can move its bfloat16 rounding by one ulp."""

    def init(params):
        master = _float32(params)
        return MasterState(master, inner.init(master))

    def update(updates, state, params=None, **extra):
        if params is None:
            raise ValueError("with_master_weights needs the parameters (optax.update(grads, state, params))")
        steps, inner_state = inner.update(_float32(updates), state.inner, state.master, **extra)
        master = optax.apply_updates(state.master, steps)
        to_master = jax.tree.map(lambda m, p: m - p.astype(m.dtype), master, params)
        return to_master, MasterState(master, inner_state)

    return optax.GradientTransformationExtraArgs(init, update)


def clip_with_norm(tree, global_norm, max_norm: float):
    """`optax.clip_by_global_norm(max_norm)` given the norm computed elsewhere (over every stage's pages), with
    optax's own arithmetic, (t / norm) * max_norm, so paged and whole-model updates agree."""
    if max_norm <= 0:
        return tree
    trigger = global_norm < max_norm
    return jax.tree.map(lambda t: jnp.where(trigger, t, (t / global_norm.astype(t.dtype)) * max_norm), tree)
