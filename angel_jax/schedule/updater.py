"""PageUpdater: runs every stage's optimizer update where its pages live, exactly or lock-free.

The executor hands over each stage's gradient pages as its backward finishes (`submit`), and, once the backward
pass is over, the global gradient norm and the anomaly guard's verdict on the loss and gradient norm (`finish`).
A worker thread then updates the stages one at a time, in forward order (the next step needs stage 0 first; in
lock-free mode the stages updated exactly go first, then the ones allowed to run behind, from the last back:
`order`): it
takes the stage's parameter and optimizer pages from the page store, runs the stage update (one jit: unpack ->
optax -> pack, `angel_jax.optim.stage_update`) on the device for resident stages or on the host (the XLA CPU backend)
for streamed ones, and puts the new pages back. Optimizer state whose home is the disk is read into host memory
ahead of its update and written back after it, so the disk works while other stages update; at most `opt_staging`
stages' optimizer pages are on the host for this at any time, read-ahead and write-backs still in flight counted
together (the plan reserves exactly that much host memory).

The guard (optim/guard.py) is the reference trainer's: an update whose loss, gradient norm or update
norm is not finite or above its bound is dropped, by every stage (each jit selects the old pages). The update norm
is global, known only once every stage's update is; when it has a bound, a first pass computes it (stage update
without writing anything) before the pass that applies. Without one, a stage whose own update is not finite keeps
its old pages (with finite gradients, as the loss and gradient-norm checks ensure, that does not happen for the
optax optimizers here).

The worker, not the training thread, waits for the disk, so the training thread can start the next step while
updates are still running; what it may use is decided per stage by `acquire`, called before a stage's first
access in a step:

- `staleness: 0` (exact): step t+1 uses a stage only after the stage's step-t update is in place. Its arrays may
  still be computing (XLA orders the computations); the training thread only waits for the update's dispatch.
- `staleness: 1` (lock-free, Angel-PTM's mechanism for hiding SSD and host-update time): a streamed stage whose
  step-t update is not yet written is used with its previous parameters, the ones step t used. The bound is one
  step: if the step t-1 update is not in place either, `acquire` waits for it. Every such use is counted in
  `stale_uses`. Stages updated on the device are always exact: the device runs one computation at a time, so
  there is nothing to hide there.

A stage in use (between `acquire` and `release`) never has its parameters replaced under it: an update that
completes meanwhile is kept pending and installed at `release`; at most `PENDING_VERSIONS` are kept at a time (the
worker waits for a release before it keeps another), which bounds the host memory of lock-free mode's second
versions of host-homed parameters.

Threads. The training thread talks to the worker only by immutable messages: `StageGrads` (`submit`) and one
`StepOrder` per step (`finish`: the step, its global gradient norm, its `Guard` and the timeline hook of that step
or None); the worker answers with the step's `Deferred` results. The worker uses nothing else a step might change:
whether a step's updates are recorded is the order's, never a field read while another thread may rewrite it.
Who owns what is stated at `PageUpdater`.
"""

from __future__ import annotations

import math
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from angel_jax.errors import AngelError
from angel_jax.memory import PageStore
from angel_jax.memory.crossing import onto
from angel_jax.memory.shardwise import Shardwise
from angel_jax.memory.tiers import HOST_MEMORY_KINDS
from angel_jax.optim.guard import StepControls, update_norm_ok
from angel_jax.schedule.staging import DEVICE_UPDATES_IN_FLIGHT, OPT_STAGING, PENDING_VERSIONS, update_order


@dataclass(frozen=True)
class StageSlot:
    """What the updater needs to know about one stage."""

    name: str
    kind: str
    param_ids: tuple[int, ...]
    opt_ids: tuple[int, ...]
    where: str
    """'device' or 'host': where the stage's update runs (disk-homed pages are staged through the host)."""
    opt_home: str
    """'device', 'host' or 'disk': the home of its optimizer-state pages."""
    param_home: str = ""
    """'device', 'host' or 'disk': the home of its parameter pages ('' = `where`)."""
    grad_home: str = ""
    """'device', 'host' or 'disk': where its gradients wait for the update ('' = `where`): 'disk' means they are
    pages in the store (written there by the executor), else arrays handed over with `submit`."""
    grad_ids: tuple[tuple[int, ...], ...] = ()
    """Disk-homed gradients: the page ids of even and of odd steps (two sets in lock-free mode, which has two
    steps' gradients of a stage at once; the same ids twice otherwise)."""
    update_on: str = ""
    """'device' or 'host': where the update computes ('' = `where`). A streamed stage whose pages live in host
    memory may update on the device (`Plan.update_at`): its pages and gradients cross to the device for the update,
    the new pages cross back into the host tier."""
    second_set: tuple[int, ...] = ()
    """Lock-free mode, parameters homed on disk: the ids of the stage's second set of parameter pages (`param_ids`
    are the first). Its versions alternate between the two, so a step using one keeps reading it while the
    update writes the next into the other; empty: one set."""

    @property
    def runs_on(self) -> str:
        return self.update_on or self.where

    @property
    def placement(self) -> str:
        """The key of its update's `Placement`: where it runs, and 'device_for_host' for a host stage updated on
        the device."""
        return "device_for_host" if self.where == "host" and self.runs_on == "device" else self.where

    @property
    def opt_where(self) -> str:
        """The tier the optimizer pages are read from and written to by the update (disk pages pass the host)."""
        return "host" if self.opt_home == "disk" else self.opt_home

    def grads_of(self, step: int) -> tuple[int, ...]:
        """The gradient page ids step `step` writes (disk-homed gradients only)."""
        return self.grad_ids[step % 2] if self.grad_ids else ()

    def params_in(self, version: int) -> tuple[int, ...]:
        """The ids of parameter set `version` (0 or 1; a stage with one set has set 0 only)."""
        return self.second_set if version else self.param_ids

    def staged_ids(self, version: int = 0) -> tuple[int, ...]:
        """Page ids of the stage's disk-homed parameters (of set `version`) and optimizer state: what is staged
        around its update."""
        return (self.params_in(version) if self.param_home == "disk" else ()) + \
            (self.opt_ids if self.opt_home == "disk" else ())

    @property
    def on_disk(self) -> bool:
        return bool(self.staged_ids()) or self.grad_home == "disk"


@dataclass(frozen=True)
class Placement:
    """Where the updates of one tier run: `compute` is the sharding the update's inputs and outputs live in while
    it runs, `tier` the sharding of the tier's pages. They are equal when the device that holds the pages can
    compute on them in place (the device tier; the host tier on the CPU backend); on an accelerator the host tier
    is pinned memory that XLA does not compute on, so host updates run on the CPU backend and pages cross over."""

    compute: jax.sharding.Sharding
    tier: jax.sharding.Sharding
    scalars: jax.sharding.Sharding | None = None
    """Where the update's scalar inputs and outputs live (the norm, the guard's verdict, step counts) when the
    pages are sharded over several devices (ZeRO-3: replicated on every rank); None: `compute`."""
    crosses: bool = False
    """Whether the pages cross between two clients on their way to the update (an accelerator's pinned host pages
    aliased onto the CPU backend, memory/crossing.py), or are made to on the CPU backend (`memory.accelerator_path`):
    the update then never writes into its inputs."""
    shardwise: Shardwise | None = None
    """ZeRO-3 pages that the update cannot compute on where they live (an accelerator's pinned host shards): each
    rank's shards cross to the CPU backend and are updated there one rank at a time (memory/shardwise.py); `compute`
    is then the tier's sharding (the pages' own, what the update takes and returns)."""

    @property
    def scalar(self) -> jax.sharding.Sharding:
        return self.scalars or self.compute

    @property
    def in_place(self) -> bool:
        """Whether the update may write its results into its input buffers: always, but where the pages cross
        between two clients (an accelerator's pinned memory aliased onto the CPU backend, memory/crossing.py). A
        copy between memory kinds of one client (host pages to the device) gives the update buffers of its own."""
        if self.crosses:  # (a shardwise placement always crosses)
            return False
        platform = {d.platform for d in self.compute.device_set} | {d.platform for d in self.tier.device_set}
        return self.compute == self.tier or len(platform) == 1


@dataclass(frozen=True)
class Guard:
    """One step's guard, from the executor: `ok` (device bool) covers the loss and the gradient norm."""

    ok: jax.Array
    max_update_norm: float
    lr_scale: float


@dataclass(frozen=True)
class StageGrads:
    """Message to the worker: stage `stage`'s gradient pages of `step`, on the tier its update reads them from
    (None: disk-homed gradients, written to the store's pages `StageSlot.grads_of(step)`)."""

    step: int
    stage: int
    grads: tuple | None


@dataclass
class _InFlight:
    """A stage's staged pages on their way out of host memory: write-backs home, and staged gradient copies to
    drop once the update that reads them has run (the disk holds the same bytes)."""

    stage: int
    writes: list
    """PageHandles of the write-backs (and drops) of its staged pages."""
    drop: tuple[int, ...] = ()
    """Staged gradient pages (host copies) to let go once `after` is ready."""
    after: Any = None

    def landed(self) -> bool:
        return not self.drop and all(h.done() for h in self.writes)

    def settle(self, store: PageStore, wait: bool = False) -> None:
        """Drop the staged gradient copies once their update ran (with `wait`: wait for it, and for the writes)."""
        if self.drop and (wait or self.after is None or self.after.is_ready()):
            jax.block_until_ready(self.after)
            # `discard`: with one set of gradient pages (exact mode), the next step's backward may already have
            # put its own gradients there, which are not this update's to drop.
            self.writes += [h for g in self.drop if (h := store.discard(g, "host")) is not None]
            self.drop = ()
        if wait:
            for h in self.writes:
                h.wait()


@dataclass(frozen=True)
class StepOrder:
    """Message to the worker: every gradient of `step` is submitted, update every stage. All the worker needs for
    the step beside the gradients; it answers with the step's deferred results (`PageUpdater.finish`)."""

    step: int
    norm: jax.Array
    """The step's global gradient norm (device scalar)."""
    guard: Guard
    record: Callable[..., None] | None = None
    """Timeline hook for this step's updates, disk reads and writes (record(stream, label, outputs,
    after=inputs), `Recorder.record`); None: the step is not recorded."""


@dataclass(frozen=True)
class UpdaterState:
    """What the updater holds of the training state beside the pages, as of the last step in flight."""

    applied: jax.Array
    """Updates applied (a dropped one does not count): the reference trainer's `TrainState.step`."""
    opt_small: tuple[tuple[jax.Array, ...], ...]
    """Per stage: the optimizer-state leaves too small for pages (step counts)."""


class StageUpdates:
    """Jitted stage updates, one per (stage kind, placement, whether parameters are donated), and first passes."""

    def __init__(self, pure: dict[str, Callable], pure_norm: dict[str, Callable],
                 rank: dict[str, Callable] | None = None, rank_norm: dict[str, Callable] | None = None):
        """`rank`, `rank_norm` (ZeRO-3): the updates of one rank's own shards alone, for placements that run them
        shard by shard (`Placement.shardwise`)."""
        self._pure, self._pure_norm = pure, pure_norm
        self._rank, self._rank_norm = rank or {}, rank_norm or {}
        self._jitted: dict[tuple, Callable] = {}
        self._lock = threading.Lock()

    def get(self, kind: str, place: Placement, donate_params: bool, donate_grads: bool = True) -> Callable:
        """The update of stage kind `kind` where `place` runs it: (params, grads, opt pages, small leaves, norm, ok,
        lr_scale) -> (params, opt pages, small, update sum of squares, applied)."""
        # The outputs (new parameter and optimizer pages) reuse donated input buffers: the old parameters and
        # optimizer pages, or, in lock-free mode, where the training thread may still be reading the old
        # parameters, the gradients in their place, unless they are the store's copies of disk-homed gradient
        # pages (`donate_grads` False), which a write to the disk may still be reading. Pages that cannot be
        # donated (`Placement.in_place` False: they crossed from an accelerator's pinned memory) go to an update
        # writing buffers of its own where it has one (the host kernel's).
        if place.shardwise is not None:
            fn = self._jit(("rank", kind, place.shardwise.compute), _fresh(self._rank[kind]), (),
                           place.shardwise.on_compute)
            return _per_rank(fn, place.shardwise, ("pages", "pages", "same", "sum", "same"))
        donate = (0, 2) if donate_params else (1, 2) if donate_grads else (2,)
        in_place = place.in_place
        pure = self._pure[kind] if in_place else _fresh(self._pure[kind])
        return self._jit(("update", kind, place.compute, donate, in_place), pure, donate, place.compute)

    def norm_pass(self, kind: str, place: Placement) -> Callable:
        if place.shardwise is not None:
            fn = self._jit(("rank norm", kind, place.shardwise.compute), self._rank_norm[kind], (),
                           place.shardwise.on_compute)
            return _per_rank(lambda *a: (fn(*a),), place.shardwise, ("sum",), single=True)
        return self._jit(("norm", kind, place.compute), self._pure_norm[kind], (), place.compute)

    def _jit(self, key: tuple, pure: Callable, donate: tuple, compute: jax.sharding.Sharding) -> Callable:
        with self._lock:
            fn = self._jitted.get(key)
            if fn is None:
                if compute.memory_kind in HOST_MEMORY_KINDS:
                    pure = in_host_memory(pure)
                # Over a mesh (ZeRO-3, even of one device) the update is a shard_map whose out_specs place its
                # outputs (the scalars replicated, not laid out as pages).
                out = None if isinstance(compute, jax.sharding.NamedSharding) else compute
                fn = self._jitted[key] = jax.jit(pure, donate_argnums=donate, out_shardings=out)
            return fn


def _fresh(pure: Callable) -> Callable:
    """The variant of an update that writes buffers of its own (the host kernel's), or the update itself."""
    return getattr(pure, "fresh_outputs", pure)


def _per_rank(fn: Callable, split: Shardwise, how: tuple[str, ...], single: bool = False) -> Callable:
    """`fn` (one rank's update, jitted on the compute device) over global pages: each local rank's shards in turn,
    the results joined (`Shardwise.call`)."""
    def call(*args: Any) -> Any:
        out = split.call(fn, args, how)
        return out[0] if single else out

    return call


def in_host_memory(fn: Callable) -> Callable:
    """`fn` over operands that live in host memory of a device that computes there (the CPU backend): XLA types
    them as host-space values, which do not mix with values it creates (padding, constants), so they are moved to
    the device space on entry and back on exit; on the CPU both are the same RAM and the moves compile to nothing
    (measured: the same time as computing in device memory)."""

    def wrapped(*args: Any) -> Any:
        args = jax.tree.map(lambda a: jax.device_put(a, jax.memory.Space.Device), args)
        return jax.tree.map(lambda a: jax.device_put(a, jax.memory.Space.Host), fn(*args))

    return wrapped


class Deferred:
    """A scalar that exists once the updater has dispatched a step's updates (update norm, skipped, lr):
    `float()`, `np.asarray()`, `jax.device_get()` and `jax.block_until_ready()` wait for it."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def set(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value, self._error = value, error
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def result(self) -> Any:
        self._event.wait()
        if self._error is not None:
            raise self._error
        return self._value

    def block_until_ready(self) -> "Deferred":
        jax.block_until_ready(self.result())
        return self

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.asarray(self.result(), dtype=dtype)

    def __float__(self) -> float:
        return float(self.result())


class UpdaterError(AngelError, RuntimeError):
    """A stage update failed in the worker (its message carries the cause: a full disk names the page and the
    bytes); raised on the training thread at its next call."""


class PageUpdater:
    """Runs the stage updates on its worker thread; every public method is called by the training thread.

    Who owns which field:
    - set at construction, never changed: `store`, `slots`, `updates`, `placements`, `schedule`, `staleness`,
      `small_specs` (the store is shared, and safe for both threads);
    - the training thread (acquire/release/finish/reset/close): `stale_uses`, `max_lag`, `_thread`;
    - the worker, while a step is in flight: `_applied`, `_opt_small`, `_ahead`, `_writing`, `_error` (set once,
      under `_cond`). The training thread reads them only through `state()` and replaces them only through
      `reset()`, both after `drain()`, when no step is in flight;
    - both, only under `_cond`: `_done`, `_held`, `_pending`, `_busy`, `_closing`, `_released` (write-backs started by
      `release` on the training thread, handed to the worker's bookkeeping).
    """

    def __init__(self, store: PageStore, slots: list[StageSlot], updates: StageUpdates, opt_small: list[list],
                 placements: dict[str, Placement], schedule: optax.Schedule, *, staleness: int,
                 inline: bool = False, newest: list[int] | None = None, opt_staging: int = OPT_STAGING,
                 lock_free_from: int = 0):
        """`inline`: dispatch each step's updates on the training thread, in `finish`, instead of a worker thread.
        For updates that are multi-device programs with collectives (ZeRO-3 pages on the CPU backend): there two
        threads dispatching such programs at once deadlock (each program's participants wait for devices the
        other's hold). The updates still run after the training thread moves on (dispatch is asynchronous);
        what is lost is only the worker's waiting for disk reads, which the training thread then does. Each update
        is waited for before the next is dispatched: a program with collectives runs alone (`Zero.serial`).
        `newest`: per stage, the set of parameter pages holding its newest version (`PagedModel.newest`, shared:
        the updater changes it as it writes stages with two sets); None: a list of the updater's own.
        `lock_free_from`: in lock-free mode, the first step (0-based) that may run a stage one update behind; the
        steps before wait for every update (`memory.lock_free_from`)."""
        if staleness not in (0, 1):
            raise ValueError(f"staleness must be 0 or 1, got {staleness}")
        if inline and staleness:
            raise ValueError("lock-free updates (staleness 1) need the updater's own thread")
        self.inline = inline
        self._inline_grads: dict[int, tuple] = {}
        self._inline_staged = False
        self.store, self.slots, self.updates, self.placements = store, slots, updates, placements
        self.schedule = schedule
        self.staleness = staleness
        self.lock_free_from = lock_free_from
        self.opt_staging = opt_staging
        """Stages of disk-homed pages held in host memory around their update (`Plan.opt_staging`)."""
        self.order: tuple[int, ...] = update_order([self._lock_free(slot) for slot in slots])
        """The order the stages update in (`staging.update_order`): stage order in exact mode; in lock-free mode
        the stages updated exactly first, then the others from the last back."""
        self.small_specs: tuple[tuple[tuple[tuple[int, ...], np.dtype], ...], ...] = tuple(
            tuple((tuple(s.shape), np.dtype(s.dtype)) for s in stage) for stage in opt_small)
        """Per stage: (shape, dtype) of each small optimizer-state leaf (fixed by the optimizer)."""
        self.stale_uses = 0
        """Stage uses that ran with parameters one update behind (lock-free mode only)."""
        self.max_lag = 0
        """The most updates a stage use was ever behind (the staleness bound: never above `staleness`)."""
        self._opt_small: list[list] = [list(stage) for stage in opt_small]
        """Per stage: the optimizer-state leaves too small for pages (step counts), kept where the update runs (a
        list per stage, as the stage update's jit was traced with)."""
        self._applied = jnp.zeros((), jnp.int32)
        """Updates applied (a dropped one does not count): the reference trainer's `TrainState.step`."""
        n = len(slots)
        self._newest = newest if newest is not None else [0] * n
        """Per stage, the set of parameter pages holding its newest version (only stages with a `second_set`
        change it; under `_cond`)."""
        self._in_use = [0] * n
        """Per stage, the set of parameter pages of the version the training thread acquired (under `_cond`)."""
        self._made: set[int] = set()
        """Pages of second sets that exist in the store (each is made by its first write)."""
        self._cond = threading.Condition()
        self._done = [0] * n
        """Per stage: updates whose results exist (installed in the store, or pending while the stage is in use)."""
        self._held = [False] * n
        self._pending: list[tuple | None] = [None] * n
        self._inbox: queue.Queue = queue.Queue()
        """Messages to the worker: StageGrads, (StepOrder, its deferred results), or None to stop."""
        self._busy = 0
        """Steps finished by the executor and not yet fully updated."""
        self._error: BaseException | None = None
        self._closing = False
        self._thread: threading.Thread | None = None
        self._ahead: set[int] = set()
        """Stages whose disk-homed optimizer pages were read into host memory for their coming update."""
        self._writing: list[_InFlight] = []
        """Staged pages of disk-homed stages still on their way out of host memory, oldest first."""
        self._released: list[_InFlight] = []
        self._crossing: list[tuple] = []
        """New pages of host stages updated on the device, on their way home, oldest first: at most
        `DEVICE_UPDATES_IN_FLIGHT` stages' pages are on the device at a time (the plan reserves that much)."""

    # ------------------------------------------------------------------------------------------ training thread
    def acquire(self, i: int, step: int) -> bool:
        """Before stage i's first access in `step` (0-based): wait until its parameters are recent enough, mark it
        in use; returns True when it runs one update behind."""
        slot = self.slots[i]
        behind = self.staleness if self._lock_free(slot) and step >= self.lock_free_from else 0
        need = step - behind
        with self._cond:
            self._wait_done(i, need, f"step {step} needs update {need} of it")
            stale = self._done[i] < step
            self.stale_uses += stale
            self.max_lag = max(self.max_lag, step - self._done[i])
            self._held[i] = True
            self._in_use[i] = self._newest[i]
            return stale

    def version_in_use(self, i: int) -> int:
        """The set of parameter pages (`StageSlot.params_in`) of the version stage i was last acquired with: the
        pages a step reads for it from `acquire` to `release`."""
        with self._cond:
            return self._in_use[i]

    def release(self, i: int) -> None:
        """After stage i's last access in a step: an update that completed meanwhile is installed now."""
        with self._cond:
            self._held[i] = False
            if self._pending[i] is not None:
                writes = self._install(i, self._pending[i])
                if writes:
                    self._released.append(_InFlight(i, writes))
                self._pending[i] = None
            self._cond.notify_all()  # (the worker may wait for room for one more pending version)

    def make_room_for_grads(self, i: int, step: int) -> None:
        """Before stage i's gradients of `step` go to the host (the training thread, in the backward): in lock-free
        mode the stage's gradients of the step before may still wait there for their update, which runs beside
        this step. Wait until that update took them, so the host holds one set of gradients per stage, what the plan
        counts. (It never waits for a stage in use: the chain, from the last stage back, has the stages before
        this one in the backward's order released by now, and keeps this one's new version pending.)"""
        slot = self.slots[i]
        if not self._lock_free(slot) or (slot.grad_home or slot.where) != "host":
            return  # (exact mode: the step before's updates took theirs before this step's forward)
        with self._cond:
            self._wait_done(i, step, f"its gradients of step {step} wait for update {step} of it")

    def _wait_done(self, i: int, need: int, why: str) -> None:
        """Wait (under `_cond`, on the training thread) until stage i has `need` updates done."""
        while self._done[i] < need:
            self._check()
            if not self._busy:
                raise UpdaterError(f"stage {self.slots[i].name!r}: {why}, and no update is in flight "
                                   f"({self._done[i]} done): the step count and the updater disagree")
            self._cond.wait(0.5)
        self._check()

    def submit(self, step: int, i: int, grads: tuple) -> None:
        """Stage i's gradient pages of `step` (on the tier its update reads them from)."""
        if self.inline:
            self._inline_grads[i] = grads
            return
        self._inbox.put(StageGrads(step, i, grads))

    def finish(self, order: StepOrder) -> dict[str, Deferred]:
        """All of `order.step`'s gradients are submitted: update every stage as the order says. Returns the step's
        update norm, skipped flag (1.0 when the update was dropped) and learning rate, deferred."""
        out = {"update_norm": Deferred(), "skipped": Deferred(), "lr": Deferred()}
        with self._cond:
            self._busy += 1
        if self.inline:
            self._inline_staged = self._run_step(order, out, self._inline_grads, self._inline_staged)
            self._check()
            return out
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="angel_jax-updater", daemon=True)
            self._thread.start()
        self._inbox.put((order, out))
        return out

    def drain(self) -> None:
        """Wait until every submitted update is in the store (for reading or replacing the state)."""
        with self._cond:
            while self._busy:
                self._check()
                self._cond.wait(0.5)
            self._check()
            assert not any(self._held) and not any(p is not None for p in self._pending)

    def state(self) -> UpdaterState:
        """The updates applied and the small optimizer-state leaves, once every step in flight is updated."""
        self.drain()
        with self._cond:
            return UpdaterState(self._applied, tuple(tuple(stage) for stage in self._opt_small))

    def reset(self, step: int, applied: int, opt_small: Sequence[Sequence[Any]]) -> None:
        """After the pages were replaced (a checkpoint loaded): every stage is up to date at `step`, `applied`
        updates were applied, and `opt_small` (per stage, arrays shaped as `small_specs`) are the small leaves."""
        if len(opt_small) != len(self.slots):
            raise ValueError(f"opt_small has {len(opt_small)} stages, the updater {len(self.slots)}")
        small = []
        for slot, specs, leaves in zip(self.slots, self.small_specs, opt_small):
            got = [(tuple(np.shape(a)), np.dtype(a.dtype)) for a in leaves]
            if got != list(specs):
                raise ValueError(f"stage {slot.name!r}: small optimizer leaves {got}, expected {list(specs)}")
            at = self.placements[slot.placement].scalar  # where its update runs
            small.append([jax.device_put(np.asarray(a), at) for a in leaves])
        self.drain()
        with self._cond:
            for flight in self._writing + self._released:
                flight.settle(self.store, wait=True)
            self._ahead.clear()  # the store was refilled: nothing is staged any more
            self._inline_staged = False
            self._writing.clear()
            self._released.clear()
            self._done = [step] * len(self.slots)
            self._applied = jnp.asarray(applied, jnp.int32)
            self._opt_small = small

    def close(self) -> None:
        if self._thread is not None:
            with self._cond:
                self._closing = True  # (a worker waiting for the release of a stage in use waits no longer)
                self._cond.notify_all()
            self._inbox.put(None)
            self._thread.join()
            self._thread = None

    # ------------------------------------------------------------------------------------------ worker
    def _check(self) -> None:
        if self._error is not None:
            raise UpdaterError(f"a stage update failed: {self._error}") from self._error

    def _run(self) -> None:
        grads: dict[int, tuple] = {}
        staged = False  # the first stages' disk reads of the coming step are issued
        while (msg := self._inbox.get()) is not None:
            if isinstance(msg, StageGrads):
                grads[msg.stage] = msg.grads
                continue
            order, out = msg
            staged = self._run_step(order, out, grads, staged)

    def _run_step(self, order: StepOrder, out: dict[str, Deferred], grads: dict[int, tuple], staged: bool) -> bool:
        """Update every stage for `order` (the worker's, or with `inline` the training thread's); returns whether
        the next step's first disk reads are issued."""
        guard, record = order.guard, order.record
        try:
            if self._error is not None:
                raise UpdaterError(f"an earlier stage update failed: {self._error}")
            if not staged:
                self._stage_first(record)
            ok = guard.ok
            if math.isfinite(guard.max_update_norm):
                total = self._norm_pass(grads, order)
                ok = ok & update_norm_ok(jnp.sqrt(total), StepControls(max_update_norm=guard.max_update_norm))
            sq, applied = {}, {}
            for k, i in enumerate(self.order):
                self._stage_disk(i, record, wait=True, step=order.step)
                for ahead in self.order[k + 1: k + self.opt_staging]:
                    self._stage_disk(ahead, record, step=order.step)
                sq[i], applied[i] = self._update(i, grads.pop(i), order, ok)
            sq, applied = [sq[i] for i in sorted(sq)], [applied[i] for i in sorted(applied)]
            self._stage_first(record)  # the next step's first disk reads start now, under its forward pass
            staged = True
            while self._crossing:  # (holding them longer would keep replaced host pages alive)
                jax.block_until_ready(self._crossing.pop(0))
            self._settle_writes()
            all_applied = self._on_device(applied, jnp.logical_and)
            # The step's last use of `record`: once the update norm is set, the recorder may be finished.
            out["update_norm"].set(jnp.sqrt(self._on_device(sq, jnp.add)))
            out["skipped"].set(1.0 - all_applied.astype(jnp.float32))
            out["lr"].set(self.schedule(self._applied) * guard.lr_scale)
            self._applied = self._applied + all_applied.astype(jnp.int32)
        except BaseException as e:  # noqa: BLE001 - surfaced on the training thread
            with self._cond:
                self._error = self._error or e
            for d in out.values():
                d.set(error=UpdaterError(f"a stage update failed: {e}"))
        finally:
            grads.clear()
            with self._cond:
                self._busy -= 1
                self._cond.notify_all()
        return staged

    def _on_device(self, values: list[jax.Array], op: Callable) -> jax.Array:
        """Fold per-stage scalars (on the device or the host) in stage order, on the device."""
        device = self.placements["device"]
        to = device.scalars or device.tier
        total = jax.device_put(values[0], to)
        for v in values[1:]:
            total = op(total, jax.device_put(v, to))
        return total

    def _stage_first(self, record: Callable[..., None] | None) -> None:
        for i in self.order[:self.opt_staging]:
            self._stage_disk(i, record)

    def _stage_disk(self, i: int, record: Callable[..., None] | None, wait: bool = False,
                    step: int | None = None) -> None:
        """Start reading stage i's disk-homed pages into host memory (parameters and optimizer state; with `step`,
        also that step's disk-homed gradients), keeping at most `opt_staging` stages staged. A read-ahead that
        does not fit is left for later; with `wait` (the stage is next) the oldest write-backs are waited for
        until it fits."""
        if i >= len(self.slots) or not self.slots[i].on_disk:
            return
        slot = self.slots[i]
        ids = slot.staged_ids(self._newest[i]) + (slot.grads_of(step) if step is not None else ())
        if i in self._ahead:
            if wait or step is not None:  # idempotent; reads pages again whose host copy went away meanwhile
                for pid in ids:
                    self.store.prefetch(pid, "host", keep_source=True)
            return
        self._settle_writes()
        while len(self._ahead) + len(self._writing) >= self.opt_staging:
            if not wait or not self._writing:
                return
            self._writing.pop(0).settle(self.store, wait=True)
        self._ahead.add(i)
        for pid in ids:
            # (keep_source: a device copy the training thread fetched meanwhile, lock-free mode, stays its own)
            handle = self.store.prefetch(pid, "host", keep_source=True)
            if record is not None:
                record("disk", f"read {slot.name}", handle)

    def _settle_writes(self) -> None:
        """Forget the write-backs that have landed; one that failed (a disk filled by another process since the
        plan was made) raises its error here, so the run stops instead of keeping the page on the host unseen."""
        with self._cond:
            self._writing += self._released
            self._released = []
        for flight in self._writing:
            flight.settle(self.store)
            for h in flight.writes:
                if h.done():
                    h.wait()
        self._writing = [f for f in self._writing if not f.landed()]

    def _written_back(self, i: int, handles: list, drop: tuple[int, ...] = (), after: Any = None) -> None:
        """Stage i's staged pages are on their way home (or dropped: the disk copy is current); `drop`: staged
        gradient copies to let go once `after` (the update reading them) is ready."""
        self._ahead.discard(i)
        self._writing.append(_InFlight(i, handles, drop, after))

    def _inputs(self, slot: StageSlot, place: Placement, grads: tuple, i: int) -> tuple:
        def to_compute(arrays: Any) -> Any:
            return onto(arrays, place.compute)

        params = to_compute(tuple(self.store.get(p, slot.where) for p in slot.params_in(self._newest[i])))
        opt = to_compute(tuple(self.store.get(o, slot.opt_where) for o in slot.opt_ids))
        return params, to_compute(grads), opt, jax.device_put(self._opt_small[i], place.scalar)

    def _grads(self, slot: StageSlot, grads: tuple | None, step: int) -> tuple:
        """The step's gradient pages of a stage: handed over, or (disk-homed) their staged copies."""
        return grads if grads is not None else tuple(self.store.get(g, "host") for g in slot.grads_of(step))

    def _norm_pass(self, grads: dict[int, tuple], order: StepOrder) -> jax.Array:
        """The update's global sum of squares, nothing written (disk pages are read, then dropped again)."""
        record, sq = order.record, {}
        for k, i in enumerate(self.order):
            slot = self.slots[i]
            self._stage_disk(i, record, wait=True, step=order.step)
            for ahead in self.order[k + 1: k + self.opt_staging]:
                self._stage_disk(ahead, record, step=order.step)
            place = self.placements[slot.placement]
            params, g, opt, small = self._inputs(slot, place, self._grads(slot, grads[i], order.step), i)
            fn = self.updates.norm_pass(slot.kind, place)
            sq[i] = fn(params, g, opt, small, jax.device_put(order.norm, place.scalar),
                       jax.device_put(np.float32(order.guard.lr_scale), place.scalar))
            del params, g, opt
            if self.inline or slot.placement == "device_for_host":  # (those: one stage's pages on the device)
                jax.block_until_ready(sq[i])
            if record is not None:
                record(self._stream(slot), f"norm {slot.name}", sq[i])
            if slot.on_disk:
                jax.block_until_ready(sq[i])  # done reading the staged copies: free them (the disk copy is current)
                self._written_back(i, [self.store.evict(pid, "host")
                                       for pid in slot.staged_ids(self._newest[i]) + slot.grads_of(order.step)])
        self._stage_first(record)
        return self._on_device([sq[i] for i in sorted(sq)], jnp.add)

    def _update(self, i: int, grads: tuple | None, order: StepOrder, ok: jax.Array) -> tuple:
        slot, store, record = self.slots[i], self.store, order.record
        place = self.placements[slot.placement]
        lock_free = self._lock_free(slot)
        # (Disk-homed gradients are the store's pages: a spill of them to the disk may still be reading the array.)
        fn = self.updates.get(slot.kind, place, donate_params=not lock_free, donate_grads=grads is not None)
        crossing = slot.placement == "device_for_host"
        while crossing and len(self._crossing) >= DEVICE_UPDATES_IN_FLIGHT:
            jax.block_until_ready(self._crossing.pop(0))  # its new pages are home: its device buffers are free
        params, grads, opt, small = self._inputs(slot, place, self._grads(slot, grads, order.step), i)
        ready_when = grads if record is not None else None  # the update starts once its gradients are home
        new_params, new_opt, small, update_sq, applied = fn(
            params, grads, opt, small, jax.device_put(order.norm, place.scalar), jax.device_put(ok, place.scalar),
            jax.device_put(np.float32(order.guard.lr_scale), place.scalar))
        if self.inline:  # (see __init__: collectives one program at a time)
            jax.block_until_ready(update_sq)
        del params, opt, grads
        self._opt_small[i] = small
        new_params, new_opt = onto(new_params, place.tier), onto(new_opt, place.tier)
        if crossing:
            self._crossing.append((new_params, new_opt))
        writes = []
        for oid, arr in zip(slot.opt_ids, new_opt):
            store.put(oid, arr, slot.opt_where)
            if slot.opt_home == "disk":
                handle = store.evict(oid, "host")  # written back home; the host copy is freed once it lands
                writes.append(handle)
                if record is not None:
                    record("disk", f"write {slot.name}", handle)
        if record is not None:
            record(self._stream(slot), f"update {slot.name}", new_params,
                   after=ready_when)
        if lock_free:
            jax.block_until_ready(new_params)  # "written": only then may the training thread pick it up
        old = slot.params_in(self._newest[i]) if slot.second_set else ()  # the version read: its staged copies
        with self._cond:
            # A version kept for a stage in use is host memory the plan counts PENDING_VERSIONS of: wait for a
            # release when that many are kept. The training thread never waits for this update meanwhile: a step
            # holds a stage only once the update before this one is in (lock-free), and releases all it holds.
            while self._held[i] and not slot.second_set and not self._closing and \
                    sum(p is not None for p in self._pending) >= PENDING_VERSIONS:
                self._cond.wait(0.5)
            if self._held[i] and not slot.second_set:
                self._pending[i] = new_params
            else:  # (a stage with two sets in use keeps reading the other set: `_install` writes this one)
                writes += self._install(i, new_params)
            self._done[i] += 1
            self._cond.notify_all()
        if slot.on_disk:  # staged gradient copies go once the update ran (the disk holds the same bytes), and a
            # second set's old parameters (their pages on disk stay for a step still using them)
            self._written_back(i, writes, drop=slot.grads_of(order.step) + old, after=update_sq)
        return update_sq, applied

    def _lock_free(self, slot: StageSlot) -> bool:
        """Whether the stage may run one update behind: lock-free mode, for stages updated on the host. A stage in
        use holds its new version until it is released; for host-homed parameters that second version is host
        memory the plan counts. Disk-homed parameters have two sets of pages on disk instead (`second_set`): the
        new version goes to the set the stage in use is not reading, so nothing waits in host memory beyond the
        window (holding it there until release would be a version for every stage in use)."""
        return self.staleness > 0 and slot.runs_on == "host" and (slot.param_home != "disk" or bool(slot.second_set))

    @staticmethod
    def _stream(slot: StageSlot) -> str:
        """The timeline row of a stage's update: the host's, the compute stream's, or for a host stage updated on
        the device, the `update` row (its kernels run between the next step's computations)."""
        return {"host": "host", "device": "compute"}.get(slot.placement, "update")

    def _install(self, i: int, new_params: tuple) -> list:
        """Put a stage's new parameters in the store; disk-homed ones start on their way home (their handles are
        returned). A stage with two sets of parameter pages gets them in the set it does not hold now, which then
        holds its newest version (called under `_cond`)."""
        slot = self.slots[i]
        target = 1 - self._newest[i] if slot.second_set else 0
        writes = []
        for pid, arr in zip(slot.params_in(target), new_params):
            if target and pid not in self._made:  # its first write: made on the host, its home then the disk
                self.store.add(pid, arr, home="host")
                self._made.add(pid)
            else:
                self.store.put(pid, arr, slot.where)
            if slot.param_home == "disk":
                writes.append(self.store.evict(pid, "host"))
        self._newest[i] = target
        return writes
