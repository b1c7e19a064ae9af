"""Cost model inputs, profiled on the real functions, shapes and memories of this process.

Each stage kind (embed, block, head) is timed once: forward, backward (recompute + vjp, or the head's loss and
gradients), its optimizer update where device-resident and where host-resident stages update, and the float32 add
of its gradient pages on the host (accumulation passes sum streamed stages' gradients there). Blocks share
one measurement, so profiling costs a handful of calls whatever the depth, and the functions it compiles are the
ones training then runs. The host <-> device copy bandwidths are measured the same way, by moving a block's
pages between the two tiers; disk bandwidths come from `angel-jax bench io`'s calibration (`load_bandwidths`),
since measuring a disk honestly needs more data than profiling should write.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from angel_jax.memory.crossing import onto
from angel_jax.memory.layout import PageLayout
from angel_jax.schedule.updater import Placement, StageUpdates
from angel_jax.schedule.simulate import Bandwidths, StageCost
from angel_jax.schedule.stagefns import HostSums, StageFunctions


def _time(fn: Callable[[], Any], setup: Callable[[], Any] = lambda: None, repeats: int = 3) -> float:
    """Median seconds of fn(setup()) over `repeats` runs, after one warm-up (compilation); setup is not timed."""
    jax.block_until_ready(fn(jax.block_until_ready(setup())))
    times = []
    for _ in range(repeats):
        args = jax.block_until_ready(setup())
        t0 = time.perf_counter()
        jax.block_until_ready(fn(args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _zeros(layout: PageLayout, name: str, sharding: jax.sharding.Sharding) -> tuple:
    return tuple(jax.device_put(np.zeros((p.length,), p.bits), sharding) for p in layout.stage(name).pages)


def _float32_zeros(layout: PageLayout, name: str, sharding: jax.sharding.Sharding) -> tuple:
    """A float32 sum of the stage's gradient pages."""
    return tuple(jax.device_put(np.zeros((p.length,), np.float32), sharding) for p in layout.stage(name).pages)


PROFILE_MICRO_BATCHES = 8
"""At most this many micro-batches are scanned in a profiled call: a micro-batch's share of the call is what the
plan needs, and stacking every micro-batch of a large step would take a large step's activations to profile."""


def profile_costs(fns: StageFunctions, updates: StageUpdates, params_layout: PageLayout, opt_layout: PageLayout,
                  opt_small: dict[str, list], tokens: jax.Array, placements: dict[str, Placement],
                  micro_batches: int = 1) -> list[StageCost]:
    """Time every stage kind on `tokens`-shaped inputs (int32[B, T+1] on the device: one micro-batch); one
    StageCost per stage. With several micro-batches, the calls the executor makes are timed: one scanning
    `micro_batches` micro-batches of that shape (`forward_micro`, `backward_micro`), and a micro-batch's share of
    it is the stage's forward or backward time (at most `PROFILE_MICRO_BATCHES` are scanned)."""
    micro_batches = min(micro_batches, PROFILE_MICRO_BATCHES)
    staged = fns.staged
    device = placements["device"].tier
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    per_kind: dict[str, tuple[float, float, float, float, float]] = {}
    host_sums = HostSums.on(placements["host"].compute, placements["host"].shardwise)
    x = inputs
    norm = jnp.ones((), jnp.float32)
    last = len(staged.stages) - 1
    for idx, stage in enumerate(staged.stages):
        kind = stage.kind
        lender = staged.borrows.get(idx)  # (a borrowing stage's calls take its lender's pages after its own)
        pages = _zeros(params_layout, stage.name, device) + (
            () if lender is None else _zeros(params_layout, staged.stages[lender].name, device))
        if kind not in per_kind:
            if micro_batches > 1:
                forward, backward = fns.forward_micro[kind], fns.backward_micro[kind]
                xs = jax.tree.map(lambda a: jnp.broadcast_to(a, (micro_batches, *a.shape)), x)  # (maybe a pytree)
                second = jnp.broadcast_to(targets, (micro_batches, *targets.shape)) if idx == last else None
            else:
                forward, backward, xs, second = fns.forward[kind], fns.backward[kind], x, targets
            if idx == last:  # (the head's last input: its share of the scored targets, any value)
                fwd_s, bwd_s = 0.0, _time(lambda _: backward(pages, xs, second, norm))
            else:
                fwd_s = _time(lambda _: forward(pages, xs))
                dy = jax.tree.map(jnp.zeros_like, forward(pages, xs))
                bwd_s = _time(lambda _: backward(pages, xs, dy))
            fwd_s, bwd_s = fwd_s / micro_batches, bwd_s / micro_batches
            update_s = {}
            for where, place in placements.items():
                if where == "device" and place.compute.device_set == placements["host"].compute.device_set:
                    continue  # one device for both (the CPU backend): the same cores, the same time
                fn = updates.get(kind, place, donate_params=True)

                def setup(name=stage.name, place=place) -> tuple:
                    return (_zeros(params_layout, name, place.tier), _zeros(params_layout, name, place.tier),
                            _zeros(opt_layout, name, place.tier), jax.device_put(opt_small[name], place.scalar),
                            jax.device_put((norm, jnp.bool_(True), jnp.float32(1.0)), place.scalar))

                def update(args: tuple, fn=fn, place=place) -> Any:
                    # As the updater runs it: the tier's pages onto the compute placement (on an accelerator, the
                    # host tier's pages cross to the CPU backend), the update, the new pages back into the tier.
                    new_params, new_opt, *rest = fn(*onto(args[:3], place.compute), args[3], *args[4])
                    return onto((new_params, new_opt), place.tier), rest

                update_s[where] = _time(update, setup)
            # A pass's gradients, arrived in the host tier, added into the sum where host updates compute.
            dtypes = tuple(p.dtype for p in params_layout.stage(stage.name).pages)
            add_s = _time(lambda args, dtypes=dtypes: host_sums.accumulate(*args, dtypes), lambda name=stage.name: (
                _float32_zeros(params_layout, name, placements["host"].compute),
                _zeros(params_layout, name, placements["host"].tier)))
            per_kind[kind] = (fwd_s, bwd_s, update_s.get("device", update_s["host"]), update_s["host"], add_s)
        if idx < last:
            x = fns.forward[kind](pages, x)
    costs = []
    for idx, stage in enumerate(staged.stages):
        fwd_s, bwd_s, upd_dev, upd_host, add_s = per_kind[stage.kind]
        costs.append(StageCost(stage.name, params_layout.stage(stage.name).nbytes, opt_layout.stage(stage.name).nbytes,
                               fwd_s, bwd_s, upd_dev, upd_host, add_s, lender=staged.borrows.get(idx)))
    return costs


def profile_transfers(params_layout: PageLayout, device: jax.sharding.Sharding, host: jax.sharding.Sharding,
                      base: Bandwidths) -> Bandwidths:
    """`base` with h2d and d2h replaced by copies of the largest stage's pages between host and device tiers."""
    stage = max(params_layout.stages, key=lambda s: s.nbytes)
    if not stage.pages:
        return base
    nbytes = stage.nbytes
    on_host = _zeros(params_layout, stage.name, host)
    on_device = _zeros(params_layout, stage.name, device)
    h2d = _time(lambda _: [jax.device_put(p, device) for p in on_host])
    d2h = _time(lambda _: [jax.device_put(p, host) for p in on_device])
    return replace(base, h2d=nbytes / max(h2d, 1e-9), d2h=nbytes / max(d2h, 1e-9),
                   source=f"h2d/d2h profiled; disk from {base.source}")
