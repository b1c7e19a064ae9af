"""Build the optax transformation and learning-rate schedule from the config."""

from __future__ import annotations

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
    """(transformation, schedule). Clipping by global norm comes first, as in every large-model recipe.

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
    if clip and cfg.grad_clip > 0:
        core = optax.chain(optax.clip_by_global_norm(cfg.grad_clip), core)
    return core, lr



def clip_with_norm(tree, global_norm, max_norm: float):
    """`optax.clip_by_global_norm(max_norm)` given the norm computed elsewhere (over every stage's pages), with
    optax's own arithmetic, (t / norm) * max_norm, so paged and whole-model updates agree."""
    import jax
    import jax.numpy as jnp

    if max_norm <= 0:
        return tree
    trigger = global_norm < max_norm
    return jax.tree.map(lambda t: jnp.where(trigger, t, (t / global_norm.astype(t.dtype)) * max_norm), tree)
