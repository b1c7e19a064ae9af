"""Optimizers: optax transformations built from `OptimizerConfig`, applied whole (reference trainer) or per stage
on pages (paged engine)."""

from angel_jax.optim.factory import clip_with_norm, make_optimizer, make_schedule

__all__ = ["clip_with_norm", "make_optimizer", "make_schedule"]
