"""Optimizers: optax transformations built from `OptimizerConfig` (factory.py), applied whole (reference trainer)
or per stage on pages (paged.py: the pure stage update; updater.py: where and when it runs, exact or lock-free)."""

from angel_jax.optim.factory import (SplitOptimizer, clip_with_norm, is_elementwise, make_optimizer, make_schedule,
                                    split_optimizer, state_buffers)

__all__ = ["SplitOptimizer", "clip_with_norm", "is_elementwise", "make_optimizer", "make_schedule", "split_optimizer",
           "state_buffers"]
