"""Cost model inputs: per-stage compute times, profiled on the real functions and shapes.

Each stage kind (embed, block, head) is timed once: forward, backward (recompute + vjp, or the head's loss and
gradients), and its optimizer update on the device and on the host. Blocks share one measurement, so profiling
costs a handful of calls whatever the depth. Transfer bandwidths come from `angel-jax bench io`
(`plan.Bandwidths.load`).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp

from angel_jax.memory.layout import PageLayout
from angel_jax.schedule.plan import StageCost
from angel_jax.schedule.stagefns import StageFunctions


def _time(fn: Callable[[], object], repeats: int = 3) -> float:
    jax.block_until_ready(fn())  # compile + warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _zeros(layout: PageLayout, name: str, sharding: jax.sharding.Sharding) -> tuple:
    return tuple(jax.device_put(jnp.zeros((p.length,), p.dtype), sharding) for p in layout.stage(name).pages)


def profile_costs(fns: StageFunctions, params_layout: PageLayout, opt_layout: PageLayout, opt_small: dict,
                  tokens: jax.Array, device_sharding: jax.sharding.Sharding) -> list[StageCost]:
    """Time every stage kind on `tokens`-shaped inputs; returns one StageCost per stage."""
    staged = fns.staged
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    per_kind: dict[str, tuple[float, float, float, float]] = {}
    x = inputs
    norm = jnp.ones((), jnp.float32)
    for idx, stage in enumerate(staged.stages):
        kind = stage.kind
        pages = _zeros(params_layout, stage.name, device_sharding)
        if kind not in per_kind:
            last = idx == len(staged.stages) - 1
            fwd_s = 0.0 if last else _time(lambda: fns.forward[kind](pages, x))
            if last:
                bwd_s = _time(lambda: fns.backward[kind](pages, x, targets))
            else:
                y = fns.forward[kind](pages, x)
                bwd_s = _time(lambda: fns.backward[kind](pages, x, jnp.zeros_like(y)))
            update_s = {}
            for where, sharding in (("device", device_sharding), ("host", fns.update_device)):
                def update(sharding=sharding) -> object:
                    p = _zeros(params_layout, stage.name, sharding)
                    g = _zeros(params_layout, stage.name, sharding)
                    o = _zeros(opt_layout, stage.name, sharding)
                    small = jax.device_put(opt_small[stage.name], sharding)
                    return fns.update[kind](p, g, o, small, jax.device_put(norm, sharding))

                # The update donates its inputs; page allocation is inside the timed call, a small overestimate.
                update_s[where] = _time(update)
            per_kind[kind] = (fwd_s, bwd_s, update_s["device"], update_s["host"])
        if idx < len(staged.stages) - 1:
            x = jax.eval_shape(fns.forward[kind], pages, x)
            x = jnp.zeros(x.shape, x.dtype)
    costs = []
    for stage in staged.stages:
        fwd_s, bwd_s, upd_dev, upd_host = per_kind[stage.kind]
        costs.append(StageCost(stage.name, params_layout.stage(stage.name).nbytes, opt_layout.stage(stage.name).nbytes,
                               fwd_s, bwd_s, upd_dev, upd_host))
    return costs
