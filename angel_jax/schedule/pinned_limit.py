"""Before jax starts its GPU client: XLA's pinned host memory limit, set to what the paged engine's plan puts in the
host tier (the client reads the limit once, at start).

    if line := configure_pinned_limit(cfg):   # first thing a training process does
        log.info(line)
"""

from __future__ import annotations

import os

from angel_jax.config import Config, ConfigError
from angel_jax.memory import pinned
from angel_jax.schedule.blueprint import blueprint
from angel_jax.schedule.budgets import host_budget, pinned_host_need


def configure_pinned_limit(cfg: Config, processes: int = 1) -> str | None:
    """Before jax starts its GPU client: set XLA's pinned host memory limit to what the paged engine's plan puts in
    the host tier (+10% + 1 GiB), unless the environment sets it, the run is not paged (memory.mode in_memory) or
    there is no NVIDIA GPU. Left at XLA's 64 GiB the pool refused plans that need more; raised to most of the RAM
    (as a benchmark once did) it grew in doubling regions past what the plan needed, into the memory the host
    updates use, and the process was killed. Returns the line that says what was set, or None."""
    if pinned.LIMIT_ENV in os.environ or cfg.memory.mode == "in_memory":
        return None
    hbm = pinned.gpu_memory_bytes()
    if hbm is None:
        return None
    try:
        sizes = blueprint(cfg).sizes
    except ConfigError:  # a model or optimizer the engine refuses: its own refusal says why
        return None
    need = pinned_host_need(cfg, sizes, hbm, processes)
    if need is None:
        return None
    gib = min(pinned.limit_for(need), max(pinned.LEAST_LIMIT_GIB, host_budget(cfg, None) // pinned.GIB))
    os.environ[pinned.LIMIT_ENV] = str(gib)
    return (f"pinned host memory limited to {gib} GiB ({pinned.LIMIT_ENV}): the plan's host tier needs "
            f"{need / pinned.GIB:.1f} GiB, + {pinned.SLACK - 1:.0%} + {pinned.OVERHEAD // pinned.GIB} GiB")
