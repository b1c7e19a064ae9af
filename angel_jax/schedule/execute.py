"""Execute: run a plan, one training step at a time, with transfers overlapping computation.

The executor holds the model as pages in a `PageStore`: resident stages live on the device (parameters and
optimizer state), streamed stages keep their parameters in pinned host memory and their optimizer state on the
host or on disk. One step follows the trace:

    forward  stage 0..N-2   stage inputs saved on the device
    head     loss and gradients
    backward stage N-2..0   recompute from the saved input, vjp; gradients of streamed stages go to the host
    update   stage 0..N-1   on the device for resident stages, on the host for streamed ones, after the global norm

A streamed stage's pages are prefetched `plan.prefetch` accesses ahead (`jax.device_put` is asynchronous and runs
on the copy streams, so the fetch overlaps the computation dispatched before it) and evicted once no access in the
window needs them. Everything is dispatched asynchronously; the host waits only where a value must exist (a page
landing from disk, the metrics at the end of the step).

With `staleness: 0` the arithmetic is the reference trainer's: the same stage functions, the same optax update,
clipping by the same global norm; only where the bytes sit differs. So streamed and resident placements give
bitwise-identical results, and both match the whole-model trainer to float rounding.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from angel_jax.memory import PageStore
from angel_jax.memory.layout import PageLayout
from angel_jax.schedule.plan import Plan
from angel_jax.schedule.stagefns import StageFunctions, join_opt_state
from angel_jax.schedule.timeline import Timeline
from angel_jax.stages import StagedModel


OPT_STAGING = 2
"""Stages of disk-resident optimizer state read into host memory ahead of their update (see plan.py)."""


@dataclass(frozen=True)
class PagedModel:
    """The static description the executor works from."""

    staged: StagedModel
    params_layout: PageLayout
    opt_layout: PageLayout
    """Optimizer-state pages; their page ids are offset by `opt_offset` in the store."""
    opt_offset: int

    def param_ids(self, stage: int) -> tuple[int, ...]:
        return self.params_layout.stage(self.staged.stages[stage].name).page_ids

    def opt_ids(self, stage: int) -> tuple[int, ...]:
        return tuple(p + self.opt_offset for p in self.opt_layout.stage(self.staged.stages[stage].name).page_ids)


class _Recorder:
    """Measured timeline: an event ends when its outputs are ready, observed by one waiter thread per stream
    (in dispatch order), and starts at the later of its dispatch and the previous event's end on the stream."""

    def __init__(self) -> None:
        self.timeline = Timeline()
        self._last_end: dict[str, float] = {}
        self._threads: list[threading.Thread] = []
        self._queues: dict[str, list] = {}
        self._lock = threading.Lock()
        self.t0 = time.perf_counter()

    def record(self, stream: str, label: str, outputs: Any) -> None:
        dispatched = time.perf_counter() - self.t0

        def wait() -> None:
            jax.block_until_ready(outputs)
            end = time.perf_counter() - self.t0
            with self._lock:
                start = max(dispatched, self._last_end.get(stream, 0.0))
                self._last_end[stream] = end
                self.timeline.add(stream, label, start, end)

        # Waiting in the caller's order per stream keeps starts and ends monotone without a thread per event.
        thread = threading.Thread(target=wait, daemon=True)
        thread.start()
        self._threads.append(thread)

    def finish(self) -> Timeline:
        for thread in self._threads:
            thread.join()
        self._threads.clear()
        return self.timeline


class PagedExecutor:
    def __init__(self, model: PagedModel, fns: StageFunctions, plan: Plan, store: PageStore,
                 opt_small: list[Any], schedule: optax.Schedule, *, record: bool = False):
        self.model, self.fns, self.plan, self.store = model, fns, plan, store
        self.opt_small = opt_small
        """Per stage: the optimizer-state leaves too small for pages (step counts), kept where the update runs."""
        self.schedule = schedule
        self.step_count = 0
        self.record = record
        self.last_timeline: Timeline | None = None
        self.on_access: Callable[[str, int], None] | None = None
        """Test hook, called after each access is dispatched (e.g. to sample live device memory)."""
        staged = model.staged
        self._n = len(staged.stages)
        self._seq = [("forward", i) for i in range(self._n - 1)] + [("head", self._n - 1)] + \
                    [("backward", i) for i in range(self._n - 2, -1, -1)]

    # ------------------------------------------------------------------------------------------------ one step
    def step(self, batch: jax.Array) -> dict[str, jax.Array]:
        plan, store, fns, staged = self.plan, self.store, self.fns, self.model.staged
        rec = _Recorder() if self.record else None
        tokens, targets = batch[:, :-1], batch[:, 1:]
        streamed = set(plan.streamed)
        refs: dict[int, int] = {}

        def issue(k: int) -> None:
            if k >= len(self._seq):
                return
            i = self._seq[k][1]
            if i not in streamed:
                return
            refs[i] = refs.get(i, 0) + 1
            if refs[i] == 1:
                for pid in self.model.param_ids(i):
                    store.prefetch(pid, "device")
                if rec:
                    rec.record("h2d", f"fetch {staged.stages[i].name}",
                               [store.get(p, "device") for p in self.model.param_ids(i)])

        def release(i: int) -> None:
            if i in streamed:
                refs[i] -= 1
                if refs[i] == 0:
                    for pid in self.model.param_ids(i):
                        store.evict(pid, "device")

        for k in range(plan.prefetch + 1):
            issue(k)
        saved: list[jax.Array | None] = [None] * self._n
        grads: list[tuple | None] = [None] * self._n
        sqsums: list[jax.Array | None] = [None] * self._n
        x: jax.Array = tokens
        loss = None
        for k, (op, i) in enumerate(self._seq):
            kind = staged.stages[i].kind
            pages = tuple(store.get(p, "device") for p in self.model.param_ids(i))
            if op == "forward":
                saved[i] = x
                x = fns.forward[kind](pages, x)
                out = x
            elif op == "head":
                dpages, x, sqsums[i], loss = fns.backward[kind](pages, x, targets)
                out = dpages
            else:
                dpages, x, sqsums[i] = fns.backward[kind](pages, saved[i], x)
                saved[i] = None
                out = dpages
            if rec:
                rec.record("compute", f"{op} {staged.stages[i].name}", out)
            if op != "forward":
                grads[i] = self._grads_home(i, dpages, streamed, rec)
            del pages
            release(i)
            issue(k + plan.prefetch + 1)
            if self.on_access is not None:
                self.on_access(op, i)

        total_sq = sqsums[0]
        for s in sqsums[1:]:
            total_sq = total_sq + s
        norm = jnp.sqrt(total_sq)
        # Optimizer state on disk is staged through host memory OPT_STAGING stages ahead of its update.
        on_disk = [i for i in range(self._n) if self.plan.opt_home[i] == "disk"]
        for i in on_disk[:OPT_STAGING]:
            self._stage_opt(i)
        update_sq = []
        for i in range(self._n):
            update_sq.append(self._update(i, grads[i], norm, streamed, rec))
            grads[i] = None
            if i in on_disk and on_disk.index(i) + OPT_STAGING < len(on_disk):
                self._stage_opt(on_disk[on_disk.index(i) + OPT_STAGING])
        update_norm = jnp.sqrt(sum(jax.device_get(u) for u in update_sq))
        lr = self.schedule(self.step_count)
        self.step_count += 1
        if rec:
            self.last_timeline = rec.finish()
            self.last_timeline.step_time = max((e.end for e in self.last_timeline.events), default=0.0)
        return {"loss": loss, "grad_norm": norm, "update_norm": update_norm, "lr": lr}

    def _stage_opt(self, i: int) -> None:
        for oid in self.model.opt_ids(i):
            self.store.prefetch(oid, "host")

    def _grads_home(self, i: int, dpages: tuple, streamed: set[int], rec: _Recorder | None) -> tuple:
        if i not in streamed:
            return dpages
        host = self.store.tiers["host"].sharding
        moved = tuple(jax.device_put(g, host) for g in dpages)
        if rec:
            rec.record("d2h", f"grad {self.model.staged.stages[i].name}", moved)
        return moved

    def _update(self, i: int, grads: tuple, norm: jax.Array, streamed: set[int], rec: _Recorder | None) -> jax.Array:
        """Stage i's optimizer update where its pages live. Host pages are updated by the XLA CPU backend: XLA
        cannot compute on `pinned_host` buffers of an accelerator, so they are handed to the CPU device (a host
        memcpy) and the results put back into the host tier."""
        store, model = self.store, self.model
        kind = model.staged.stages[i].kind
        opt_ids = model.opt_ids(i)
        if i in streamed:
            where, run_on = "host", self.fns.update_device
            home = store.tiers["host"].sharding
        else:
            where, run_on = "device", store.tiers["device"].sharding
            home = run_on
        params = tuple(jax.device_put(store.get(p, where), run_on) for p in model.param_ids(i))
        opt = tuple(jax.device_put(store.get(o, where), run_on) for o in opt_ids)
        grads = tuple(jax.device_put(g, run_on) for g in grads)
        new_params, new_opt, small, update_sq = self.fns.update[kind](
            params, grads, opt, jax.device_put(self.opt_small[i], run_on), jax.device_put(norm, run_on))
        del params, opt, grads
        self.opt_small[i] = small
        for pid, arr in zip(model.param_ids(i), new_params):
            store.update(pid, jax.device_put(arr, home), where)
        for oid, arr in zip(opt_ids, new_opt):
            store.update(oid, jax.device_put(arr, home), where)
            if self.plan.opt_home[i] == "disk":
                store.evict(oid, "host")  # written back to its disk home, host copy freed once it lands
        if rec:
            rec.record("host" if where == "host" else "compute", f"update {model.staged.stages[i].name}",
                       (new_params, new_opt))
        return update_sq

    # ------------------------------------------------------------------------------------------------ state access
    def stage_params(self, i: int) -> Any:
        """Stage i's parameters as numpy arrays (from wherever the current version is)."""
        name = self.model.staged.stages[i].name
        pages = tuple(self.store.read(p) for p in self.model.param_ids(i))
        return self.model.params_layout.stage(name).unpack(pages)

    def params(self) -> Any:
        """The whole model's parameters (numpy), in the reference trainer's structure."""
        self.store.wait_all()
        return self.model.staged.merge([self.stage_params(i) for i in range(self._n)])

    def opt_state(self, i: int) -> Any:
        name = self.model.staged.stages[i].name
        big = list(self.model.opt_layout.stage(name).unpack(tuple(self.store.read(o) for o in self.model.opt_ids(i))))
        small = [np.asarray(s) for s in self.opt_small[i]]
        return join_opt_state(big, small, self.fns._opt_structure[self.model.staged.stages[i].kind])
