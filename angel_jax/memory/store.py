"""PageStore: where every page lives, and the asynchronous moves between tiers.

Each page has a *home* tier (its authoritative copy: 'host' or 'disk' for streamed state, 'device' for resident
state) and at most one copy per tier, so the device never holds two live copies of a page. Copies carry the
page's version; `update` makes a new version on one tier, drops the stale non-home copies at once and leaves the
home copy stale ("dirty") until `writeback` or an `evict` writes the new version home.

Moves are asynchronous and return a `PageHandle`:

- `prefetch(p, to)`: bring a current copy to tier `to` from the nearest tier holding one (device <- host <- disk).
  The source is freed when the copy lands unless it is the home copy (or a pinned device copy).
- `evict(p, frm)`: stop holding the page on `frm`. A copy that is the only current one is first written to the
  home tier; evicting the home copy itself moves the page (and its home) one tier down (device -> host -> disk).
- `writeback(p)`: write the current version to the home tier, keeping the current copy.

Budgets are checked when a move is issued: a move that does not fit raises `BudgetExceeded` and changes nothing.
A move that fails later (a disk error) completes its handle with the error and is rolled back: the destination is
freed and the source stays where it was. Sources are freed only once the destination is complete (for jax
transfers: `block_until_ready` in a worker thread), so memory is never lost in between; a tier's `bytes_used`
counts a page from its reservation to its free, so once every handle is waited for, each array tier's
`bytes_used` equals the bytes of the live jax arrays it holds.

Device <-> host moves are `jax.device_put` to the destination sharding (issued on the caller's thread, in order,
so they overlap compute). Disk moves run on a small thread pool: device/host -> disk converts with `np.asarray`
(the D2H copy) and writes through tensorstore; disk -> device/host reads (checksum verified) and `device_put`s.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import jax
import numpy as np

from angel_jax.memory.disk_tier import DiskTier
from angel_jax.memory.errors import PagePinned, PageStoreError
from angel_jax.memory.handles import PageHandle, StagingBuffers, copy_result, resolved
from angel_jax.memory.tiers import ArrayTier, DeviceTier, HostTier, Tier

ROLES = ("device", "host", "disk")
# Where to copy from, nearest first, for each destination.
_SOURCE_ORDER = {"device": ("host", "disk"), "host": ("device", "disk"), "disk": ("host", "device")}
_LOWER = {"device": "host", "host": "disk", "disk": None}


@dataclass(eq=False)
class _Copy:
    tier: str
    version: int
    future: cf.Future = field(default_factory=cf.Future)
    """Data complete: the jax.Array (array tiers) or None (disk)."""
    settled: cf.Future = field(default_factory=cf.Future)
    """The move that made this copy is finished, bookkeeping included (source freed or rolled back)."""
    array: jax.Array | None = None
    """Array-tier copies: the array, as soon as its transfer has been issued."""
    leaving: bool = False
    """Being moved away: dropped when that move completes, kept if it fails."""
    cancelled: bool = False
    """Dropped: no longer counted, and a transfer still in flight for it is discarded on arrival."""
    readers: list[cf.Future] = field(default_factory=list)
    """Moves reading this copy: dropping it waits for them before freeing anything."""


@dataclass(eq=False)
class _Page:
    id: int
    nbytes: int
    dtype: np.dtype
    length: int
    home: str
    version: int = 0
    copies: dict[str, _Copy] = field(default_factory=dict)
    pins: int = 0
    dropping: dict[str, cf.Future] = field(default_factory=dict)
    """tier -> completion of a dropped copy's free that waits for its readers; no new copy there until then."""

    def current(self, tier: str) -> _Copy | None:
        c = self.copies.get(tier)
        return c if c is not None and not c.leaving and c.version == self.version else None


class PageStore:
    """Pages across device, host and (optionally) disk tiers. Thread-safe; construction allocates nothing."""

    def __init__(self, device: DeviceTier | None = None, host: HostTier | None = None,
                 disk: DiskTier | None = None, *, workers: int = 4):
        self.tiers: dict[str, Tier] = {"device": device if device is not None else DeviceTier(),
                                       "host": host if host is not None else HostTier()}
        if disk is not None:
            self.tiers["disk"] = disk
        self._pages: dict[int, _Page] = {}
        self._lock = threading.RLock()
        self._workers = workers
        self._pool: cf.ThreadPoolExecutor | None = None
        self._inflight: set[cf.Future] = set()
        self._errors: list[BaseException] = []
        self._staging = StagingBuffers(keep=workers)

    # --- queries ----------------------------------------------------------------------------------------------------
    def page_ids(self) -> list[int]:
        with self._lock:
            return sorted(self._pages)

    def where(self, page_id: int) -> tuple[str, ...]:
        """Tiers holding (or receiving) the current version, device first."""
        with self._lock:
            page = self._page(page_id)
            return tuple(t for t in ROLES if page.current(t) is not None)

    def home(self, page_id: int) -> str:
        with self._lock:
            return self._page(page_id).home

    def is_dirty(self, page_id: int) -> bool:
        """Whether the home copy is older than the current version."""
        with self._lock:
            page = self._page(page_id)
            return page.current(page.home) is None

    def bytes_used(self) -> dict[str, int]:
        return {name: tier.bytes_used for name, tier in self.tiers.items()}

    def stats(self) -> dict[str, Any]:
        with self._lock:
            count = {t: sum(1 for p in self._pages.values() if p.current(t)) for t in self.tiers}
        out: dict[str, Any] = {t: {**tier.stats(), "current_pages": count[t]} for t, tier in self.tiers.items()}
        out["staging_idle_bytes"] = self._staging.idle_bytes
        return out

    # --- placement --------------------------------------------------------------------------------------------------
    def add(self, page_id: int, value: jax.Array | np.ndarray, home: str = "host") -> PageHandle:
        """Register a page with its first copy on `home`. A jax.Array already in the home tier's memory is
        taken over (not copied); anything else is copied in."""
        with self._lock:
            if page_id in self._pages:
                raise PageStoreError(f"page {page_id} is already in the store (home {self._pages[page_id].home!r})")
            tier = self._tier(home)
            if value.ndim != 1:
                raise PageStoreError(f"page {page_id}: pages are 1-D arrays, got shape {tuple(value.shape)}")
            page = _Page(page_id, int(value.nbytes), np.dtype(value.dtype), int(value.shape[0]), home)
            copy = _Copy(home, 0)
            if isinstance(tier, ArrayTier):
                if isinstance(value, jax.Array) and value.sharding == tier.sharding:
                    tier.adopt(page_id, value)
                    copy.array = value
                else:
                    copy.array = tier.put(page_id, value)
                self._submit(self._ready, copy.array).add_done_callback(lambda f: copy_result(f, copy.future))
            else:
                assert isinstance(tier, DiskTier)
                tier.open()
                tier.reserve(page_id, tier.page_bytes(page.nbytes))
                try:
                    tier.write(page_id, np.asarray(value), reserved=True).add_done_callback(
                        lambda f: copy_result(f, copy.future))
                except BaseException:
                    tier.free(page_id)
                    raise
            page.copies[home] = copy
            self._pages[page_id] = page
            self._watch(page, None, copy, [], on_fail=lambda: self._pages.pop(page_id, None))
            return PageHandle(page_id, f"add->{home}", copy.settled)

    def remove(self, page_id: int) -> None:
        """Forget a page and free every copy of it."""
        with self._lock:
            page = self._page(page_id)
            if page.pins:
                raise PagePinned(f"page {page_id} is pinned ({page.pins}x); unpin it before removing it")
            for copy in list(page.copies.values()):
                self._drop(page, copy)
            del self._pages[page_id]

    # --- moves ------------------------------------------------------------------------------------------------------
    def prefetch(self, page_id: int, to: str = "device") -> PageHandle:
        return self._retrying(lambda: self._prefetch(page_id, to))

    def evict(self, page_id: int, frm: str = "device", to: str | None = None) -> PageHandle:
        return self._retrying(lambda: self._evict(page_id, frm, to))

    def writeback(self, page_id: int) -> PageHandle:
        """Write the current version to the home tier (no-op when the home copy is current)."""
        return self._retrying(lambda: self._writeback(page_id))

    def _prefetch(self, page_id: int, to: str) -> PageHandle:
        with self._lock:
            page, tier = self._page(page_id), self._tier(to)
            have = page.copies.get(to)
            if have is not None and have.version == page.version:
                if have.leaving:
                    # Logically gone already: act as if the page were copied back to `to` from its nearest
                    # other copy, which is then freed if it is not home, exactly as a real move would do.
                    # (The move taking `have` away completes as a copy instead.) Same state, whatever the timing.
                    have.leaving = False
                    src = self._source(page, to, exclude=to, required=False)
                    if src is not None and src.tier != page.home and not (src.tier == "device" and page.pins):
                        src.leaving = True
                        self._watch(page, src, have, [src], None)
                return PageHandle(page_id, f"prefetch->{to} (present)", have.settled)
            if have is not None:  # a stale copy: only the home copy can be stale
                return self._writeback(page_id)
            src = self._source(page, to)
            frees_src = src.tier != page.home and not (src.tier == "device" and page.pins)
            dst = self._start_copy(page, src, to, [src] if frees_src else [])
            return PageHandle(page_id, f"prefetch {src.tier}->{to}", dst.settled)

    def _evict(self, page_id: int, frm: str, to: str | None) -> PageHandle:
        with self._lock:
            page = self._page(page_id)
            self._tier(frm)
            copy = page.copies.get(frm)
            if copy is None or copy.leaving:
                raise PageStoreError(f"page {page_id} is not on {frm!r} (current copies: {self._where(page)})")
            if frm == "device" and page.pins:
                raise PagePinned(f"page {page_id} is pinned on the device ({page.pins}x); it cannot be evicted")
            is_home = frm == page.home
            target = to or (_LOWER[frm] if is_home else page.home)
            if target is None or target == frm:
                raise PageStoreError(f"page {page_id}: nowhere to evict it from {frm!r} (home {page.home!r})")
            self._tier(target)
            prev_home = page.home
            have = page.copies.get(target)
            if have is not None and have.version == page.version:
                have.leaving = False
                self._drop(page, copy)
                page.home = target if is_home else page.home
                return PageHandle(page_id, f"evict {frm} (copy on {target})", have.settled)
            src = copy if copy.version == page.version else self._source(page, target, exclude=frm)
            if have is not None:  # stale: replaced by the new version
                self._check_fits(page, target, have)
                self._drop(page, have)

            def on_fail() -> None:
                if is_home and page.home == target:
                    page.home = prev_home

            dst = self._start_copy(page, src, target, [copy], on_fail)
            if is_home:
                page.home = target
            return PageHandle(page_id, f"evict {frm}->{target}", dst.settled)

    def _writeback(self, page_id: int) -> PageHandle:
        with self._lock:
            page = self._page(page_id)
            have = page.current(page.home)
            if have is not None:
                return PageHandle(page_id, f"writeback->{page.home} (clean)", have.settled)
            src = self._source(page, page.home)
            stale = page.copies.get(page.home)
            if stale is not None:
                self._check_fits(page, page.home, stale)
                self._drop(page, stale)
            dst = self._start_copy(page, src, page.home, [])
            return PageHandle(page_id, f"writeback {src.tier}->{page.home}", dst.settled)

    def update(self, page_id: int, new: jax.Array, tier: str = "device") -> None:
        """Install a new version of the page on `tier` (e.g. a stage's updated pages). The old array there is
        deleted (if `new` is not the same object), stale non-home copies are dropped, the home copy becomes
        dirty."""
        self.get(page_id, tier)  # waits for a copy still landing
        with self._lock:
            page, t = self._page(page_id), self._tier(tier)
            old = page.current(tier)
            if old is None or not isinstance(t, ArrayTier):
                raise PageStoreError(f"page {page_id}: no current copy on {tier!r} to update "
                                     f"(current copies: {self._where(page)})")
            if tuple(new.shape) != (page.length,) or np.dtype(new.dtype) != page.dtype:
                raise PageStoreError(f"page {page_id}: update must be {page.dtype}[{page.length}], "
                                     f"got {np.dtype(new.dtype)}{list(new.shape)}")
            t.adopt(page_id, new, replace=True)
            old.cancelled = True
            page.version += 1
            fresh = _Copy(tier, page.version, resolved(new), resolved(new), array=new)
            page.copies[tier] = fresh
            for role, copy in list(page.copies.items()):
                if copy is not fresh and role != page.home:
                    self._drop(page, copy)

    # --- access -----------------------------------------------------------------------------------------------------
    def get(self, page_id: int, tier: str = "device") -> jax.Array:
        """The page's current array on `tier` (waits for a copy from disk that is still landing)."""
        with self._lock:
            page = self._page(page_id)
            copy = page.current(tier)
            if copy is None or tier == "disk":
                raise PageStoreError(f"page {page_id} has no current copy on {tier!r} "
                                     f"(current copies: {self._where(page)}); prefetch it first")
            if copy.array is not None:
                return copy.array
        copy.future.result()
        with self._lock:
            if copy.array is None or copy.cancelled:
                raise PageStoreError(f"page {page_id}: its copy on {tier!r} was dropped while landing")
            return copy.array

    def read(self, page_id: int) -> np.ndarray:
        """The current value as a numpy array (a copy), from the nearest tier holding it."""
        with self._lock:
            page = self._page(page_id)
            copy = next((page.current(t) for t in ("host", "device", "disk") if page.current(t)), None)
            if copy is None:
                raise PageStoreError(f"page {page_id} has no current copy")
        copy.future.result()
        if copy.tier == "disk":
            return self._disk().read(page_id).result()
        return np.array(copy.array)

    def pin(self, *page_ids: int) -> None:
        """Mark pages in use: a pinned page cannot be evicted from the device, and a move never frees its
        device copy."""
        with self._lock:
            for pid in page_ids:
                self._page(pid).pins += 1

    def unpin(self, *page_ids: int) -> None:
        with self._lock:
            for pid in page_ids:
                page = self._page(pid)
                if page.pins == 0:
                    raise PageStoreError(f"page {pid} is not pinned")
                page.pins -= 1

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
            for pid in list(self._pages):
                self._pages[pid].pins = 0
                self.remove(pid)
        self.wait_all()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._staging.clear()
        disk = self.tiers.get("disk")
        if close_disk and isinstance(disk, DiskTier):
            disk.close()

    # --- internals --------------------------------------------------------------------------------------------------
    def _page(self, page_id: int) -> _Page:
        try:
            return self._pages[page_id]
        except KeyError:
            raise PageStoreError(f"page {page_id} is not in the store") from None

    def _tier(self, role: str) -> Tier:
        try:
            return self.tiers[role]
        except KeyError:
            raise PageStoreError(f"no tier {role!r} in this store (tiers: {', '.join(self.tiers)})") from None

    def _disk(self) -> DiskTier:
        disk = self._tier("disk")
        assert isinstance(disk, DiskTier)
        return disk

    @staticmethod
    def _where(page: _Page) -> str:
        return ", ".join(t for t in ROLES if page.current(t)) or "none"

    def _source(self, page: _Page, to: str, exclude: str | None = None, required: bool = True) -> _Copy | None:
        """The current copy to copy from, nearest first; copies already leaving only if nothing else has it."""
        candidates = [page.copies.get(role) for role in _SOURCE_ORDER[to] if role != exclude]
        candidates = [c for c in candidates if c is not None and c.version == page.version and not c.cancelled]
        for copy in sorted(candidates, key=lambda c: c.leaving):
            return copy
        if required:
            raise PageStoreError(f"page {page.id}: no current copy to move to {to!r}")
        return None

    def _check_fits(self, page: _Page, role: str, replaced: _Copy) -> None:
        """Refuse before dropping `replaced` if the page would still not fit on `role` once it is gone."""
        tier = self.tiers[role]
        if tier.budget is not None:
            need = tier.page_bytes(page.nbytes) - tier.charged(page.id)
            if need > tier.budget - tier.bytes_used:
                tier.reserve(-1 - page.id, need)  # raises BudgetExceeded with the numbers
                tier.release(-1 - page.id)

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
                res.add_done_callback(lambda f: copy_result(f, out))
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

        fut.add_done_callback(start)
        return out

    @staticmethod
    def _ready(arr: jax.Array) -> jax.Array:
        try:
            arr.block_until_ready()
        except Exception:
            if not arr.is_deleted():  # deleted: the copy was dropped while in flight, nothing to wait for
                raise
        return arr

    def _start_copy(self, page: _Page, src: _Copy, role: str, leaving: list[_Copy],
                    on_fail: Callable[[], None] | None = None) -> _Copy:
        """Issue a copy of `src` to tier `role` (under the lock). Raises before changing anything if the tier
        cannot take the page; `leaving` copies are dropped once the copy is complete."""
        tier, pid = self.tiers[role], page.id
        if role in page.dropping:  # the tier still frees an old copy (readers in flight): retry after it
            raise _Retry(page.dropping[role])
        if isinstance(tier, DiskTier):
            tier.open()
        tier.reserve(pid, tier.page_bytes(page.nbytes))
        dst = _Copy(role, src.version)
        try:
            if isinstance(tier, ArrayTier) and src.array is not None:
                dst.array = tier.put(pid, src.array, reserved=True)
                self._submit(self._ready, dst.array).add_done_callback(lambda f: copy_result(f, dst.future))
            elif isinstance(tier, ArrayTier):  # from disk, or from a copy still landing from disk
                staged = src.tier == "disk"
                first = self._then(src.future, lambda _: self._read_staged(page)) if staged else src.future
                self._then(first, lambda value: self._land(page, dst, tier, value, staged)).add_done_callback(
                    lambda f: copy_result(f, dst.future))
            else:
                assert isinstance(tier, DiskTier)
                self._then(src.future, lambda arr: tier.write(pid, np.asarray(arr), reserved=True)
                           ).add_done_callback(lambda f: copy_result(f, dst.future))
        except BaseException:
            tier.free(pid)
            raise
        for c in leaving:
            c.leaving = True
        src.readers.append(dst.future)
        page.copies[role] = dst
        self._watch(page, src, dst, leaving, on_fail)
        return dst

    def _read_staged(self, page: _Page) -> cf.Future:
        buf = self._staging.take(page.dtype, page.length)
        fut = self._disk().read(page.id, into=buf)
        fut.add_done_callback(lambda f: self._staging.give(buf) if f.exception() is not None else None)
        return fut

    def _land(self, page: _Page, dst: _Copy, tier: ArrayTier, value: np.ndarray | jax.Array, staged: bool) -> Any:
        """Put data that arrived (from disk, or from a copy that was itself landing) into `dst`'s tier."""
        with self._lock:
            if dst.cancelled:  # dropped while in flight: pass the data on to any move chained on this one
                if staged:
                    value, buf = np.array(value), value
                    self._staging.give(buf)
                return value
            dst.array = tier.put(page.id, value, reserved=True)
        try:
            return self._ready(dst.array)
        finally:
            if staged:
                self._staging.give(value)  # ArrayTier.put copied it and the copy is complete

    def _watch(self, page: _Page, src: _Copy | None, dst: _Copy, leaving: list[_Copy],
               on_fail: Callable[[], None] | None) -> None:
        """When `dst`'s data is complete: drop the leaving copies (success) or undo the move (failure); then
        settle `dst` so its handle wakes up with everything in place."""
        with self._lock:
            self._inflight.add(dst.settled)

        def finish(f: cf.Future) -> None:
            error = f.exception()
            try:
                with self._lock:
                    if error is None and not dst.cancelled:
                        for c in leaving:
                            if c.leaving and page.copies.get(c.tier) is c:
                                self._drop(page, c)
                    else:
                        if not dst.cancelled:
                            self._drop(page, dst)
                            if on_fail is not None:
                                on_fail()
                        for c in leaving:
                            c.leaving = False
                        if error is not None:
                            self._errors.append(error)
            except BaseException as e:  # noqa: BLE001 - a handle must never hang on a bookkeeping error
                error = error or e
                self._errors.append(e)
            finally:
                with self._lock:
                    self._inflight.discard(dst.settled)
                if error is not None and f.exception() is None:
                    dst.settled.set_exception(error)
                else:
                    copy_result(f, dst.settled)

        dst.future.add_done_callback(finish)

    def _drop(self, page: _Page, copy: _Copy) -> None:
        """Forget a copy and free its tier's bytes; the free waits for moves still reading the copy and, on
        the disk, for its own write still in flight."""
        if page.copies.get(copy.tier) is copy:
            del page.copies[copy.tier]
        if copy.cancelled:
            return
        copy.cancelled = True
        tier = self.tiers[copy.tier]

        def free() -> None:
            if isinstance(tier, ArrayTier) and copy.array is None:
                tier.release(page.id)  # never landed: `_land` discards it
            else:
                tier.free(page.id)

        waits = [f for f in copy.readers if not f.done()]
        if isinstance(tier, DiskTier) and not copy.future.done():
            waits.append(copy.future)
        if not waits:
            free()
            return
        freed: cf.Future = cf.Future()
        page.dropping[copy.tier] = freed
        self._inflight.add(freed)
        left = [len(waits)]

        def one_done(_: cf.Future) -> None:
            with self._lock:
                left[0] -= 1
                if left[0]:
                    return
                try:
                    free()
                finally:
                    if page.dropping.get(copy.tier) is freed:
                        del page.dropping[copy.tier]
                    self._inflight.discard(freed)
            freed.set_result(None)

        for f in waits:
            f.add_done_callback(one_done)

    def _retrying(self, op: Callable[[], PageHandle]) -> PageHandle:
        """Run a move; if it needs a tier slot that an old copy of the page is still freeing, wait for that
        free (without the lock: it needs it) and run the move again from the then-current state."""
        while True:
            try:
                return op()
            except _Retry as r:
                r.freed.result()


class _Retry(Exception):
    def __init__(self, freed: cf.Future):
        super().__init__("retry after a pending free")
        self.freed = freed
