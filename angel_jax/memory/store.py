"""PageStore: where every page lives, and the asynchronous moves between tiers.

Each page has a *home* tier (its authoritative copy: 'host' or 'disk' for streamed state, 'device' for resident
state) and at most one copy per tier, so the device never holds two live copies of a page. Copies carry the
page's version; `update` makes a new version on one tier, drops the stale non-home copies at once and leaves the
home copy stale ("dirty") until `writeback` or an `evict` writes the new version home.

Moves are asynchronous and return a `PageHandle`:

- `prefetch(p, to)`: bring a current copy to tier `to` from the nearest tier holding one (device <- host <- disk).
  The source is freed when the copy lands unless it is the home copy (or a pinned device copy, or the caller
  says `keep_source`).
- `evict(p, frm)`: stop holding the page on `frm`. A copy that is the only current one is first written to the
  home tier; evicting the home copy itself moves the page (and its home) one tier down (device -> host -> disk).
- `writeback(p)`: write the current version to the home tier, keeping the current copy.

Budgets are checked when a move is issued: a move that does not fit raises `BudgetExceeded` and changes nothing.
A move that fails later (a disk error) completes its handle with the error and is rolled back: the destination is
freed and the source stays where it was. Sources are freed only once the destination is complete (for jax
transfers: `block_until_ready` in a worker thread), so memory is never lost in between; a tier's `bytes_used`
counts a page from its reservation to its free, so once every handle is waited for, each array tier's
`bytes_used` equals the bytes of the live jax arrays it holds.

The rules above live in `PageTable` (page_table.py), a pure state machine; this class only carries out its
decisions. Under one lock it asks the table what an event means (a `Move` to start, a copy already `Present`, a
`Blocked` request to ask again later, `Free`s to do), does the data movement, and tells the table when a move
`landed` or `failed`. The data of each copy (its jax.Array and futures) is kept here, by the table's copy id.

Device <-> host moves are `jax.device_put` to the destination sharding (issued on the caller's thread, in order,
so they overlap compute). Disk moves run on a small thread pool: device/host -> disk converts with `np.asarray`
(the D2H copy) and writes through tensorstore; disk -> device/host reads (checksum verified) into a reused
staging buffer and `device_put`s.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Iterator

import jax
import numpy as np

from angel_jax.memory.disk_tier import DiskTier
from angel_jax.memory.shards import ProcessShards
from angel_jax.memory.errors import PageStoreError
from angel_jax.memory.handles import PageHandle, StagingBuffers, copy_result, resolved, when_done
from angel_jax.memory.page_table import ROLES, Blocked, Decision, Free, Installed, Move, PageTable, Present
from angel_jax.memory.tiers import ArrayTier, DeviceTier, HostTier, Tier

__all__ = ["PageStore", "PageHandle", "ROLES"]


@dataclass(eq=False)
class _Data:
    """The data side of one copy (the table knows its state)."""
    future: cf.Future = field(default_factory=cf.Future)
    """Data complete: the jax.Array (array tiers) or None (disk)."""
    settled: cf.Future = field(default_factory=cf.Future)
    """The move that made this copy is finished, bookkeeping included (source freed or rolled back)."""
    array: jax.Array | None = None
    """Array-tier copies: the array, as soon as its transfer has been issued."""
    freed: bool = False
    """Freed (dropped while in flight): data still arriving is passed on to chained moves, not kept."""


class _Budgets(Mapping):
    """The tiers' budgets as the table reads them: live, so a budget set on a tier later counts at once."""

    def __init__(self, tiers: dict[str, Tier]):
        self._tiers = tiers

    def __getitem__(self, role: str) -> int | None:
        return self._tiers[role].budget

    def __iter__(self) -> Iterator[str]:
        return iter(self._tiers)

    def __len__(self) -> int:
        return len(self._tiers)


class PageStore:
    """Pages across device, host and (optionally) disk tiers. Thread-safe; construction allocates nothing."""

    def __init__(self, device: DeviceTier | None = None, host: HostTier | None = None,
                 disk: DiskTier | None = None, *, workers: int = 4):
        self.tiers: dict[str, Tier] = {"device": device if device is not None else DeviceTier(),
                                       "host": host if host is not None else HostTier()}
        if disk is not None:
            self.tiers["disk"] = disk
        self._table = PageTable(_Budgets(self.tiers), lambda role, nbytes: self.tiers[role].page_bytes(nbytes))
        self._data: dict[int, _Data] = {}
        self._meta: dict[int, tuple[np.dtype, int]] = {}
        """page id -> (dtype, length): what the table does not need to know."""
        self._lock = threading.RLock()
        self._moved = threading.Condition(self._lock)
        """Notified whenever a move finishes: what a `Blocked` request waits for."""
        self._workers = workers
        self._pool: cf.ThreadPoolExecutor | None = None
        self._inflight: set[cf.Future] = set()
        self._errors: list[BaseException] = []
        self._staging = StagingBuffers(keep=workers)
        self.process_shards = ProcessShards.of(self.tiers["host"].sharding)
        """Pages sharded over the devices of several processes: the disk tier holds this process's part of each
        (no process can read a whole page), and reads of it come back as that part."""

    # --- queries ----------------------------------------------------------------------------------------------
    def page_ids(self) -> list[int]:
        with self._lock:
            return self._table.page_ids()

    def where(self, page_id: int) -> tuple[str, ...]:
        """Tiers holding (or receiving) the current version, device first."""
        with self._lock:
            return self._table.where(page_id)

    def home(self, page_id: int) -> str:
        with self._lock:
            return self._table.home(page_id)

    def is_dirty(self, page_id: int) -> bool:
        """Whether the home copy is older than the current version."""
        with self._lock:
            return self._table.is_dirty(page_id)

    def bytes_used(self) -> dict[str, int]:
        return {name: tier.bytes_used for name, tier in self.tiers.items()}

    def stats(self) -> dict[str, Any]:
        with self._lock:
            count = {t: self._table.count_current(t) for t in self.tiers}
        out: dict[str, Any] = {t: {**tier.stats(), "current_pages": count[t]} for t, tier in self.tiers.items()}
        out["staging_idle_bytes"] = self._staging.idle_bytes
        return out

    # --- events -----------------------------------------------------------------------------------------------
    def add(self, page_id: int, value: jax.Array | np.ndarray, home: str = "host") -> PageHandle:
        """Register a page with its first copy on `home`. A jax.Array already in the home tier's memory is
        taken over (not copied); anything else is copied in."""
        if value.ndim != 1:
            raise PageStoreError(f"page {page_id}: pages are 1-D arrays, got shape {tuple(value.shape)}")

        def issue(move: Move) -> None:
            self._meta[page_id] = (np.dtype(value.dtype), int(value.shape[0]))
            self._issue_add(move, value)

        return self._request(lambda: self._table.add(page_id, int(value.nbytes), home), issue)

    def remove(self, page_id: int) -> None:
        """Forget a page and free every copy of it."""
        with self._lock:
            self._carry_out(self._table.remove(page_id))

    def prefetch(self, page_id: int, to: str = "device", keep_source: bool = False) -> PageHandle:
        return self._request(lambda: self._table.prefetch(page_id, to, keep_source))

    def evict(self, page_id: int, frm: str = "device", to: str | None = None) -> PageHandle:
        return self._request(lambda: self._table.evict(page_id, frm, to))

    def discard(self, page_id: int, tier: str) -> PageHandle | None:
        """Let go of a staging copy: the current copy on `tier`, when that is not the home tier and the home copy
        holds the same version (nothing is written). None, and nothing done, when there is no such copy: it
        went already, or a newer version was installed there meanwhile (whoever installed it moves it)."""
        with self._lock:
            t = self._table
            if t.current_copy(page_id, tier) is None or t.home(page_id) == tier or t.is_dirty(page_id):
                return None
            return self.evict(page_id, tier)

    def writeback(self, page_id: int) -> PageHandle:
        """Write the current version to the home tier (no-op when the home copy is current)."""
        return self._request(lambda: self._table.writeback(page_id))

    def update(self, page_id: int, new: jax.Array, tier: str = "device") -> None:
        """Install a new version of the page on `tier` (e.g. a stage's updated pages). The old array there is
        deleted (if `new` is not the same object), stale non-home copies are dropped, the home copy becomes
        dirty."""
        self.get(page_id, tier)  # waits for a copy still landing
        self._install(page_id, new, tier, self._table.update)

    def put(self, page_id: int, new: jax.Array, tier: str = "host") -> None:
        """As `update`, but the page need not have a copy on `tier`: one is charged there afresh if it has none
        (BudgetExceeded if it does not fit). For pages rewritten whole (gradients each step), and for updates
        whose staged input copy may have been dropped meanwhile."""
        self._install(page_id, new, tier, self._table.put)

    def _install(self, page_id: int, new: jax.Array, tier: str, ask: Callable[[int, str], Decision]) -> None:
        with self._lock:
            t = self._tier(tier)
            dtype, length = self._meta_of(page_id)
            if isinstance(t, ArrayTier) and (tuple(new.shape) != (length,) or np.dtype(new.dtype) != dtype):
                raise PageStoreError(f"page {page_id}: update must be {dtype}[{length}], "
                                     f"got {np.dtype(new.dtype)}{list(new.shape)}")
            if isinstance(t, ArrayTier):
                t.check_resident(page_id, new)  # refused before the table changes anything
            while True:
                decision = ask(page_id, tier)
                if not isinstance(decision.action, Blocked):
                    break
                self._moved.wait()  # a copy still landing there (moved meanwhile by another thread)
            installed = decision.action
            assert isinstance(installed, Installed) and isinstance(t, ArrayTier)
            if installed.replaced is None:
                self._carry_out(decision)  # (a stale copy there goes first)
                t.adopt(page_id, new)
                decision = Decision(installed)
            else:
                t.adopt(page_id, new, replace=True)  # deletes the replaced array, keeps the page's bytes counted
                self._data.pop(installed.replaced, None)
            self._data[installed.copy] = _Data(resolved(new), resolved(new), new)
            self._carry_out(decision)

    # --- access -----------------------------------------------------------------------------------------------
    def get(self, page_id: int, tier: str = "device") -> jax.Array:
        """The page's current array on `tier` (waits for a copy from disk that is still landing)."""
        with self._lock:
            copy = self._table.current_copy(page_id, tier)
            if copy is None or tier == "disk":
                raise PageStoreError(f"page {page_id} has no current copy on {tier!r} "
                                     f"(current copies: {', '.join(self._table.where(page_id)) or 'none'}); "
                                     f"prefetch it first")
            data = self._data[copy]
            if data.array is not None:
                return data.array
        data.future.result()
        with self._lock:
            if data.array is None or not self._table.is_live(page_id, tier, copy):
                raise PageStoreError(f"page {page_id}: its copy on {tier!r} was dropped while landing")
            return data.array

    def read(self, page_id: int) -> np.ndarray:
        """The current value as a numpy array (a copy), from the nearest tier holding it. Pages sharded over the
        devices of several processes are read from the disk only, and as this process's part (`ProcessShards`)."""
        with self._lock:
            tier, copy = self._table.nearest_current(page_id)
            data = self._data[copy]
        data.future.result()
        if tier == "disk":
            return self._disk().read(page_id).result()
        return np.array(data.array)

    def pin(self, *page_ids: int) -> None:
        """Mark pages in use: a pinned page cannot be evicted from the device, and a move never frees its
        device copy."""
        with self._lock:
            self._table.pin(*page_ids)

    def unpin(self, *page_ids: int) -> None:
        with self._lock:
            self._table.unpin(*page_ids)

    @contextlib.contextmanager
    def pinned(self, page_ids: Iterable[int]) -> Iterator[None]:
        ids = tuple(page_ids)
        self.pin(*ids)
        try:
            yield
        finally:
            self.unpin(*ids)

    def wait_all(self) -> list[BaseException]:
        """Wait for every move issued so far; return the errors of moves that failed since the last call."""
        while True:
            with self._lock:
                pending = [f for f in self._inflight if not f.done()]
            if not pending:
                break
            cf.wait(pending)
        with self._lock:
            errors, self._errors = self._errors, []
        return errors

    def close(self, close_disk: bool = True) -> None:
        """Wait for moves, free every page on every tier, stop the worker threads; with `close_disk`, also
        close the disk tier (removing its scratch subdirectory)."""
        self.wait_all()
        with self._lock:
            for pid in self._table.page_ids():
                self._carry_out(self._table.remove(pid, force=True))
        self.wait_all()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._staging.clear()
        disk = self.tiers.get("disk")
        if close_disk and isinstance(disk, DiskTier):
            disk.close()

    # --- carrying out decisions -------------------------------------------------------------------------------
    def _request(self, ask: Callable[[], Decision], issue: Callable[[Move], None] | None = None) -> PageHandle:
        """Ask the table (again, each time a move finished, while it answers Blocked), carry out its answer,
        and return the handle of the move started or of the copy already there."""
        with self._lock:
            while True:
                decision = ask()
                if not isinstance(decision.action, Blocked):
                    break
                self._moved.wait()
            self._carry_out(decision)
            action = decision.action
            if isinstance(action, Present):
                return PageHandle(action.page, action.label, self._data[action.copy].settled)
            assert isinstance(action, Move)
            data = self._data[action.dst_copy] = _Data()
            self._inflight.add(data.settled)
            try:
                (issue or self._issue)(action)
            except BaseException:
                self._inflight.discard(data.settled)
                self._carry_out(self._table.failed(action))
                raise
            when_done(data.future, lambda f: self._finish(action, data, f))
            return PageHandle(action.page, action.label, data.settled)

    def _carry_out(self, decision: Decision) -> None:
        """Do the frees a decision asks for (under the lock)."""
        for free in decision.frees:
            self._free(free)

    def _free(self, free: Free) -> None:
        self.tiers[free.tier].free(free.page)  # the array (or chunk file), or only the reservation
        data = self._data.pop(free.copy, None)
        if data is not None:
            data.freed = True

    def _finish(self, move: Move, data: _Data, f: cf.Future) -> None:
        """`move`'s data is complete (or failed): tell the table, do what it says, wake whoever waits for a
        move to finish; then settle the handle, so it wakes up with everything in place."""
        settled = data.settled
        error = f.exception()
        try:
            with self._lock:
                self._carry_out(self._table.failed(move) if error is not None else self._table.landed(move))
                if error is not None:
                    self._errors.append(error)
        except BaseException as e:  # noqa: BLE001 - a handle must never hang on a bookkeeping error
            error = error or e
            with self._lock:
                self._errors.append(e)
        finally:
            with self._lock:
                self._inflight.discard(settled)
                self._moved.notify_all()
            if error is not None and f.exception() is None:
                settled.set_exception(error)
            else:
                copy_result(f, settled)

    # --- data movement ----------------------------------------------------------------------------------------
    def _issue_add(self, move: Move, value: jax.Array | np.ndarray) -> None:
        """Start writing the page's first copy from the caller's value (its bytes are reserved)."""
        tier, dst = self.tiers[move.dst], self._data[move.dst_copy]
        if isinstance(tier, ArrayTier):
            if isinstance(value, jax.Array) and value.sharding == tier.sharding:
                tier.adopt(move.page, value)  # counts the bytes itself
                dst.array = value
            else:
                self._reserve(tier, move)
                dst.array = tier.put(move.page, value, reserved=True)
            when_done(self._submit(self._ready, dst.array), lambda f: copy_result(f, dst.future))
        else:
            assert isinstance(tier, DiskTier)
            tier.open()
            self._reserve(tier, move)
            when_done(tier.write(move.page, self._to_disk(value), reserved=True), lambda f: copy_result(f, dst.future))

    def _issue(self, move: Move) -> None:
        """Start copying `move.src_copy` to `move.dst` (under the lock; the destination's bytes are charged in
        the table, and reserved in the tier here)."""
        tier, pid = self.tiers[move.dst], move.page
        src, dst = self._data[move.src_copy], self._data[move.dst_copy]
        if isinstance(tier, DiskTier):
            tier.open()
        self._reserve(tier, move)
        if isinstance(tier, ArrayTier) and src.array is not None:
            dst.array = tier.put(pid, src.array, reserved=True)
            when_done(self._submit(self._ready, dst.array), lambda f: copy_result(f, dst.future))
        elif isinstance(tier, ArrayTier):  # from disk, or from a copy still landing from disk
            staged, (dtype, length) = move.src == "disk", self._meta[pid]
            first = src.future
            if staged:
                first = self._then(src.future, lambda _: self._read_staged(pid, dtype, length))
            when_done(self._then(first, lambda value: self._land(pid, dst, tier, value, staged)),
                      lambda f: copy_result(f, dst.future))
        else:
            assert isinstance(tier, DiskTier)
            when_done(self._then(src.future, lambda arr: tier.write(pid, self._to_disk(arr), reserved=True)),
                      lambda f: copy_result(f, dst.future))

    def _reserve(self, tier: Tier, move: Move) -> None:
        """Count the destination's bytes in the tier object, as the table already does."""
        tier.reserve(move.page, self._table.charge(move.dst, move.page))

    def _to_disk(self, value: jax.Array | np.ndarray) -> np.ndarray:
        """What the disk tier stores of a page: the page, or this process's part of it."""
        return np.asarray(value) if self.process_shards is None else self.process_shards.local(value)

    def _read_staged(self, page_id: int, dtype: np.dtype, length: int) -> cf.Future:
        buf = self._staging.take(dtype, length if self.process_shards is None else self.process_shards.length(length))
        fut = self._disk().read(page_id, into=buf)
        when_done(fut, lambda f: self._staging.give(buf) if f.exception() is not None else None)
        return fut

    def _land(self, page_id: int, dst: _Data, tier: ArrayTier, value: np.ndarray | jax.Array, staged: bool) -> Any:
        """Put data that arrived (from disk, or from a copy that was itself landing) into `dst`'s tier."""
        with self._lock:
            if dst.freed:  # dropped while in flight: pass the data on to any move chained on this one
                if staged:
                    value, buf = np.array(value), value
                    self._staging.give(buf)
                return value
            page = value
            if self.process_shards is not None and isinstance(value, np.ndarray):  # this process's part, from its disk
                page = self.process_shards.page(value, tier.sharding)
            dst.array = tier.put(page_id, page, reserved=True)
        try:
            return self._ready(dst.array)
        finally:
            if staged:
                self._staging.give(value)  # ArrayTier.put copied it and the copy is complete

    @staticmethod
    def _ready(arr: jax.Array) -> jax.Array:
        try:
            arr.block_until_ready()
        except Exception as e:
            # Deleted: the copy was replaced while in flight. Donated: a computation took the page as a donated
            # input (an update writing its new version over it; XLA waits for the copy before running it), which
            # can happen while this thread waits for the copy: the array's own deleted flag is set only when that
            # computation's dispatch returns, so the error can come first (seen with the updates of pages
            # sharded over several devices under load: the move was then taken for failed and the staged copy
            # freed under the update). Either way there is nothing left to wait for.
            if not (arr.is_deleted() or "deleted or donated" in str(e)):
                raise
        return arr

    # --- plumbing ---------------------------------------------------------------------------------------------
    def _tier(self, role: str) -> Tier:
        try:
            return self.tiers[role]
        except KeyError:
            raise PageStoreError(f"no tier {role!r} in this store (tiers: {', '.join(self.tiers)})") from None

    def _disk(self) -> DiskTier:
        disk = self._tier("disk")
        assert isinstance(disk, DiskTier)
        return disk

    def _meta_of(self, page_id: int) -> tuple[np.dtype, int]:
        self._table.home(page_id)  # raises "not in the store"
        return self._meta[page_id]

    def _submit(self, fn: Callable, *args: Any) -> cf.Future:
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(self._workers, thread_name_prefix="angel_jax-pagestore")
        return self._pool.submit(fn, *args)

    def _then(self, fut: cf.Future, fn: Callable[[Any], Any]) -> cf.Future:
        """A future of fn(fut.result()), run on the pool; fn may return a future, which is then followed."""
        out: cf.Future = cf.Future()

        def run(value: Any) -> None:
            try:
                res = fn(value)
            except BaseException as e:  # noqa: BLE001 - propagate to the move's handle
                out.set_exception(e)
                return
            if isinstance(res, cf.Future):
                when_done(res, lambda f: copy_result(f, out))
            else:
                out.set_result(res)

        def start(f: cf.Future) -> None:
            if f.exception() is not None:
                out.set_exception(f.exception())
                return
            try:
                self._submit(run, f.result())
            except BaseException as e:  # noqa: BLE001 - e.g. the store was closed: fail the move, never hang
                out.set_exception(e)

        when_done(fut, start)
        return out
