"""PageTable: the bookkeeping of where every page lives, as a pure state machine.

`PageStore` moves bytes; this module decides *which* bytes move and keeps the books. It has no clock, no I/O, no
threads, no jax and no futures: every method takes an event (a request such as `prefetch`, or the news that a move
`landed` or `failed`) and answers with a `Decision`, changing its state in the same step. The store carries the
decision out and reports back. Keeping the rules here, apart from the data movement, is what lets every rule be
tested on event sequences without arrays, disks or timing (tests/test_memory_page_table.py).

The model:

- A page has a *home* tier (its authoritative copy), a version, a pin count and at most one copy per tier. A copy
  is *current* when it has the page's version and is not leaving; it is *in flight* while the move that makes it
  (its maker) has not landed.
- `update` makes a new version on one tier; other non-home copies are dropped at once and the home copy stays
  stale ("dirty") until `writeback` or `evict` writes the new version home.
- A move copies a current copy (the source) to another tier. Budgets are checked when it is issued; a request the
  table refuses (BudgetExceeded, PagePinned, PageStoreError) raises before changing anything.
- Copies a move takes away (`Move.frees`) are only marked *leaving*; they are dropped when the move lands and kept
  when it fails, so a page is never without a complete copy. That holds for letting go of a copy in favour of
  one still landing too (an `evict` whose target already receives the current version): the copy leaves with
  that move. A failed move is rolled back: its destination is dropped and a home it moved is restored.
- A dropped copy stays charged to its tier while a move still reads it, and on the disk while its own write
  runs (it *drains*); the `Free` comes with the event that ends the last of those moves. No new copy can go to
  that tier meanwhile (a tier holds one entry per page): such a request is answered `Blocked`, to be asked again
  after a move finished.
- Prefetching a copy that is leaving claims it back, as if it were copied back from the nearest other copy, which
  is then freed as that move would free it. The final state is the same whatever the timing.

Accounting mirrors the tiers exactly: a page is charged to a tier from the move (or `add`) that reserves it until
the `Free` that releases it, so `used(tier)` equals what the store's tier objects count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, NamedTuple

from angel_jax.memory.errors import BudgetExceeded, PagePinned, PageStoreError

ROLES = ("device", "host", "disk")
SOURCE_ORDER = {"device": ("host", "disk"), "host": ("device", "disk"), "disk": ("host", "device")}
"""Where to copy from, nearest first, for each destination."""
LOWER = {"device": "host", "host": "disk", "disk": None}
"""Where evicting a home copy sends the page (and its home)."""


# --- decisions --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Move:
    """A copy to carry out: the current version of `page` from `src` (None: the page's first copy, from the
    caller's value) to `dst`. `frees` are the tiers whose copies go once it lands (as issued: a later `evict`
    onto its destination can add one). `src_copy`/`dst_copy` name
    the copies, so the mover can find their data; `label` describes the move for its handle."""
    id: int
    page: int
    src: str | None
    dst: str
    version: int
    frees: tuple[str, ...]
    src_copy: int | None
    dst_copy: int
    label: str


@dataclass(frozen=True)
class Present:
    """Nothing to move: the caller waits for copy `copy` on `tier` (complete, or landing)."""
    page: int
    tier: str
    copy: int
    label: str


@dataclass(frozen=True)
class Installed:
    """`update` installed copy `copy` on `tier`, replacing copy `replaced` (whose bytes it takes over)."""
    page: int
    tier: str
    copy: int
    replaced: int | None
    """None: there was no copy on `tier` (`put`)."""


@dataclass(frozen=True)
class Blocked:
    """A copy in the way on `tier` is still read or written by a move: ask again after a move finished."""
    page: int
    tier: str


@dataclass(frozen=True)
class Free:
    """Release copy `copy` of `page` on `tier`: its data and its bytes."""
    page: int
    tier: str
    copy: int


Action = Move | Present | Installed | Blocked | None


class CopyInfo(NamedTuple):
    """What the table tells about one copy."""
    id: int
    version: int
    in_flight: bool
    leaving: bool


@dataclass(frozen=True)
class Decision:
    """The answer to one event: what to start (or wait for), and which copies to free now."""
    action: Action = None
    frees: tuple[Free, ...] = ()


# --- state ------------------------------------------------------------------------------------------------------
@dataclass(eq=False)
class _Copy:
    id: int
    page: int
    tier: str
    version: int
    cost: int
    """Bytes charged to its tier."""
    maker: int | None
    """The move writing this copy; None once it landed."""
    leaving: bool = False
    """A move takes it away: dropped when that move lands, kept if it fails."""
    readers: set[int] = field(default_factory=set)
    """Moves reading it: a dropped copy is freed only after them."""
    live: bool = True
    """Still the page's copy on its tier (False once dropped or replaced)."""
    charged: bool = True
    """Counted in its tier's bytes (False once freed, or when `update` handed its bytes to a new copy)."""


@dataclass(eq=False)
class _Page:
    id: int
    nbytes: int
    home: str
    version: int = 0
    pins: int = 0
    copies: dict[str, _Copy] = field(default_factory=dict)

    def current(self, tier: str) -> _Copy | None:
        c = self.copies.get(tier)
        return c if c is not None and not c.leaving and c.version == self.version else None

    def where(self) -> str:
        return ", ".join(t for t in ROLES if self.current(t)) or "none"


@dataclass(eq=False)
class _Flight:
    """A move in flight, with what landing or failing it has to change."""
    move: Move
    page: _Page
    src: _Copy | None
    dst: _Copy
    leaving: list[_Copy]
    home_before: str | None = None
    """Set when the move also moved the page's home (evicting the home copy): restored if it fails."""


class PageTable:
    """Pages, their copies and the tiers' byte budgets. Not thread-safe: the caller serialises events.

    `budgets` maps each tier present to its budget in bytes (None: unlimited); it is read at every decision, so a
    live view of changing budgets works. `page_bytes(tier, nbytes)` is what a page costs on a tier.
    `finish_writes`: tiers that cannot drop a copy while it is being written (the disk: a chunk file being
    written cannot be deleted). A copy dropped in flight on any other tier is freed at once, and the mover
    discards its data when it arrives (jax frees an array deleted while its transfer runs)."""

    def __init__(self, budgets: Mapping[str, int | None],
                 page_bytes: Callable[[str, int], int] = lambda tier, nbytes: nbytes,
                 finish_writes: tuple[str, ...] = ("disk",)):
        unknown = set(budgets) - set(ROLES)
        if unknown:
            raise ValueError(f"unknown tiers {sorted(unknown)}; tiers are {ROLES}")
        self.budgets = budgets
        self._cost = page_bytes
        self.finish_writes = finish_writes
        self._pages: dict[int, _Page] = {}
        self._charged: dict[str, dict[int, int]] = {t: {} for t in budgets}
        self._draining: dict[tuple[int, str], _Copy] = {}
        self._flights: dict[int, _Flight] = {}
        self._last_id = -1

    # --- queries ----------------------------------------------------------------------------------------------
    @property
    def tiers(self) -> tuple[str, ...]:
        return tuple(self.budgets)

    def page_ids(self) -> list[int]:
        return sorted(self._pages)

    def home(self, page_id: int) -> str:
        return self._page(page_id).home

    def version(self, page_id: int) -> int:
        return self._page(page_id).version

    def where(self, page_id: int) -> tuple[str, ...]:
        """Tiers holding (or receiving) the current version, device first."""
        page = self._page(page_id)
        return tuple(t for t in ROLES if page.current(t) is not None)

    def is_dirty(self, page_id: int) -> bool:
        """Whether the home copy is older than the current version (or on its way out)."""
        page = self._page(page_id)
        return page.current(page.home) is None

    def current_copy(self, page_id: int, tier: str) -> int | None:
        """The id of the current copy on `tier`, if any."""
        c = self._page(page_id).current(tier)
        return None if c is None else c.id

    def is_live(self, page_id: int, tier: str, copy: int) -> bool:
        """Whether copy `copy` is still the page's current copy on `tier` (False if the page is gone)."""
        page = self._pages.get(page_id)
        c = None if page is None else page.current(tier)
        return c is not None and c.id == copy

    def copies(self, page_id: int) -> dict[str, CopyInfo]:
        """Every copy of the page, by tier."""
        return {t: CopyInfo(c.id, c.version, c.maker is not None, c.leaving)
                for t, c in self._page(page_id).copies.items()}

    def draining(self) -> dict[tuple[int, str], int]:
        """(page, tier) -> id of a dropped copy still charged while moves read or write it."""
        return {k: c.id for k, c in self._draining.items()}

    def used(self, tier: str) -> int:
        return sum(self._charged[tier].values())

    def charged(self, tier: str) -> dict[int, int]:
        """page id -> bytes charged on `tier`."""
        return dict(self._charged[tier])

    def charge(self, tier: str, page_id: int) -> int:
        """Bytes charged on `tier` for one page (0 if none)."""
        return self._charged[tier].get(page_id, 0)

    def in_flight(self) -> tuple[Move, ...]:
        return tuple(f.move for f in self._flights.values())

    def count_current(self, tier: str) -> int:
        return sum(1 for p in self._pages.values() if p.current(tier))

    def nearest_current(self, page_id: int, order: tuple[str, ...] = ("host", "device", "disk")) -> tuple[str, int]:
        """(tier, copy id) of the first current copy in `order`."""
        page = self._page(page_id)
        for t in order:
            c = page.current(t)
            if c is not None:
                return t, c.id
        raise PageStoreError(f"page {page_id} has no current copy")

    # --- events: placement ------------------------------------------------------------------------------------
    def add(self, page_id: int, nbytes: int, home: str) -> Decision:
        """A new page whose first copy, on `home`, comes from the caller's value: a `Move` with no source."""
        if page_id in self._pages:
            raise PageStoreError(f"page {page_id} is already in the store (home {self._pages[page_id].home!r})")
        self._tier(home)
        if (page_id, home) in self._draining:  # an earlier page of that id is still being freed there
            return Decision(Blocked(page_id, home))
        page = _Page(page_id, nbytes, home)
        self._reserve(page, home)
        self._pages[page_id] = page
        move = self._start(page, None, home, [], f"add->{home}")
        return Decision(move)

    def remove(self, page_id: int, force: bool = False) -> Decision:
        """Forget a page; its copies are freed (once no move reads or writes them). `force` ignores pins."""
        page = self._page(page_id)
        if page.pins and not force:
            raise PagePinned(f"page {page_id} is pinned ({page.pins}x); unpin it before removing it")
        frees = [f for c in list(page.copies.values()) for f in self._drop(page, c)]
        del self._pages[page_id]
        return Decision(None, tuple(frees))

    def pin(self, *page_ids: int) -> None:
        """A pinned page cannot be evicted from the device, and no move frees its device copy."""
        pages = [self._page(pid) for pid in page_ids]
        for page in pages:
            page.pins += 1

    def unpin(self, *page_ids: int) -> None:
        pages = [self._page(pid) for pid in page_ids]
        need: dict[int, int] = {}
        for page in pages:
            need[page.id] = need.get(page.id, 0) + 1
            if page.pins < need[page.id]:
                raise PageStoreError(f"page {page.id} is not pinned")
        for page in pages:
            page.pins -= 1

    # --- events: moves ----------------------------------------------------------------------------------------
    def prefetch(self, page_id: int, to: str, keep_source: bool = False) -> Decision:
        """Bring a current copy to `to` from the nearest tier holding one; the source goes when it lands unless
        it is the home copy or a pinned device copy, or `keep_source` (a copy someone else staged there and still
        uses, e.g. parameters staged on the host for their update while the forward pass reads them too)."""
        page = self._page(page_id)
        self._tier(to)
        have = page.copies.get(to)
        if have is not None and have.version == page.version:
            frees: list[Free] = []
            if have.leaving:
                frees = self._claim_back(page, have, keep_source)
            return Decision(Present(page_id, to, have.id, f"prefetch->{to} (present)"), tuple(frees))
        if have is not None:  # a stale copy: only the home copy can be stale
            return self.writeback(page_id)
        src = self._source(page, to)
        if (page_id, to) in self._draining:
            return Decision(Blocked(page_id, to))
        self._reserve(page, to)
        leaving = [src] if self._frees_source(page, src) and not keep_source else []
        return Decision(self._start(page, src, to, leaving, f"prefetch {src.tier}->{to}"))

    def evict(self, page_id: int, frm: str, to: str | None = None) -> Decision:
        """Stop holding the page on `frm`. The only current copy is first written to the home tier (or `to`);
        evicting the home copy moves the page, and its home, one tier down."""
        page = self._page(page_id)
        self._tier(frm)
        copy = page.copies.get(frm)
        if copy is None or copy.leaving:
            raise PageStoreError(f"page {page_id} is not on {frm!r} (current copies: {page.where()})")
        if frm == "device" and page.pins:
            raise PagePinned(f"page {page_id} is pinned on the device ({page.pins}x); it cannot be evicted")
        is_home = frm == page.home
        target = to or (LOWER[frm] if is_home else page.home)
        if target is None or target == frm:
            raise PageStoreError(f"page {page_id}: nowhere to evict it from {frm!r} (home {page.home!r})")
        self._tier(target)
        have = page.copies.get(target)
        if have is not None and have.version == page.version:  # already there: just let go of `frm`
            have.leaving = False
            frees = self._leave_once_landed(page, copy, have, move_home=is_home)
            return Decision(Present(page_id, target, have.id, f"evict {frm} (copy on {target})"), tuple(frees))
        src = copy if copy.version == page.version else self._source(page, target, exclude=frm)
        blocked, frees = self._replace_stale(page, target)
        if blocked is not None:
            return Decision(blocked)
        self._reserve(page, target)
        home_before = page.home if is_home else None
        move = self._start(page, src, target, [copy], f"evict {frm}->{target}", home_before)
        if is_home:
            page.home = target
        return Decision(move, frees)

    def writeback(self, page_id: int) -> Decision:
        """Write the current version to the home tier, keeping the current copy (nothing to do if clean)."""
        page = self._page(page_id)
        have = page.current(page.home)
        if have is not None:
            return Decision(Present(page_id, page.home, have.id, f"writeback->{page.home} (clean)"))
        src = self._source(page, page.home)
        blocked, frees = self._replace_stale(page, page.home)
        if blocked is not None:
            return Decision(blocked)
        self._reserve(page, page.home)
        return Decision(self._start(page, src, page.home, [], f"writeback {src.tier}->{page.home}"), frees)

    def update(self, page_id: int, tier: str) -> Decision:
        """A new version on `tier`, taking over the bytes of the current copy there; other non-home copies are
        dropped, the home copy becomes stale. A copy still landing there, or still read by a move, is waited for
        (`Blocked`)."""
        page = self._page(page_id)
        self._tier(tier)
        old = page.current(tier)
        if old is None or tier == "disk":
            raise PageStoreError(f"page {page_id}: no current copy on {tier!r} to update "
                                 f"(current copies: {page.where()})")
        if old.maker is not None or old.readers:
            # Still landing, or still being read by a move (a write-back home): the new version replaces the
            # old array, which the tier deletes, so wait until nothing reads it.
            return Decision(Blocked(page_id, tier))
        page.version += 1
        new = _Copy(self._new_id(), page_id, tier, page.version, old.cost, maker=None)
        old.live = old.charged = False  # its bytes are the new copy's now: the tier replaces one with the other
        page.copies[tier] = new
        frees = [f for role, c in list(page.copies.items()) if c is not new and role != page.home
                 for f in self._drop(page, c)]
        return Decision(Installed(page_id, tier, new.id, old.id), tuple(frees))

    def put(self, page_id: int, tier: str) -> Decision:
        """A new version on `tier` whether or not the page has a current copy there (e.g. an update whose staged
        input copy was dropped meanwhile, or a page rewritten every step): as `update` when it has one; else the
        page is charged to `tier` afresh (BudgetExceeded if it does not fit; a stale copy there is dropped
        first), other non-home copies are dropped and the home copy becomes stale."""
        page = self._page(page_id)
        self._tier(tier)
        if tier == "disk":
            raise PageStoreError(f"page {page_id}: a new version is made on an array tier, not on the disk")
        if page.current(tier) is not None:
            return self.update(page_id, tier)
        blocked, frees = self._replace_stale(page, tier)
        if blocked is not None:
            return Decision(blocked)
        self._reserve(page, tier)
        page.version += 1
        new = _Copy(self._new_id(), page_id, tier, page.version, self._charged[tier][page.id], maker=None)
        page.copies[tier] = new
        frees += tuple(f for role, c in list(page.copies.items()) if c is not new and role != page.home
                       for f in self._drop(page, c))
        return Decision(Installed(page_id, tier, new.id, None), tuple(frees))

    # --- events: completions ----------------------------------------------------------------------------------
    def landed(self, move: Move) -> Decision:
        """`move`'s destination is complete: the copies it took away go (unless claimed back meanwhile)."""
        flight = self._finish(move)
        page, dst = flight.page, flight.dst
        frees = self._end_read(flight)
        if dst.live:
            for c in flight.leaving:
                if c.leaving and page.copies.get(c.tier) is c:
                    frees += self._drop(page, c)
        else:  # dropped while in flight: the move changed nothing, keep what it would have taken away
            for c in flight.leaving:
                c.leaving = False
            frees += self._settle(dst)
        return Decision(None, tuple(frees))

    def failed(self, move: Move) -> Decision:
        """`move` failed (or could not be started): roll it back. Its destination goes, the copies it would
        have taken away stay, a home it moved is restored; a failed `add` forgets the page."""
        flight = self._finish(move)
        page, dst = flight.page, flight.dst
        frees = self._end_read(flight)
        if dst.live:
            frees += self._drop(page, dst)
            if flight.home_before is not None and page.home == move.dst:
                page.home = flight.home_before
            if move.src is None and self._pages.get(page.id) is page:
                frees += self.remove(page.id, force=True).frees
        else:
            frees += self._settle(dst)
        for c in flight.leaving:
            c.leaving = False
        return Decision(None, tuple(frees))

    # --- internals --------------------------------------------------------------------------------------------
    def _page(self, page_id: int) -> _Page:
        try:
            return self._pages[page_id]
        except KeyError:
            raise PageStoreError(f"page {page_id} is not in the store") from None

    def _tier(self, role: str) -> None:
        if role not in self.budgets:
            raise PageStoreError(f"no tier {role!r} in this store (tiers: {', '.join(self.budgets)})")

    def _source(self, page: _Page, to: str, exclude: str | None = None, required: bool = True) -> _Copy | None:
        """The current-version copy to copy from, nearest first; a leaving one only if nothing else has it."""
        candidates = [page.copies.get(role) for role in SOURCE_ORDER[to] if role != exclude]
        candidates = [c for c in candidates if c is not None and c.version == page.version]
        for copy in sorted(candidates, key=lambda c: c.leaving):
            return copy
        if required:
            raise PageStoreError(f"page {page.id}: no current copy to move to {to!r}")
        return None

    @staticmethod
    def _frees_source(page: _Page, src: _Copy) -> bool:
        """A prefetch takes its source away unless it is the home copy or a pinned device copy."""
        return src.tier != page.home and not (src.tier == "device" and page.pins)

    def _claim_back(self, page: _Page, have: _Copy, keep_source: bool = False) -> list[Free]:
        """Prefetching a leaving copy: keep it, and treat it as copied back from the nearest other copy, which
        goes as that copy would (now, or when `have` lands; never with `keep_source`). The move taking `have`
        away becomes a copy."""
        have.leaving = False
        src = self._source(page, have.tier, exclude=have.tier, required=False)
        if src is None or keep_source or not self._frees_source(page, src):
            return []
        return self._leave_once_landed(page, src, have)

    def _leave_once_landed(self, page: _Page, copy: _Copy, have: _Copy, move_home: bool = False) -> list[Free]:
        """Let go of `copy` in favour of `have` (a current copy elsewhere): now if `have` is complete, else as
        part of the move making it, so that a failure of that move keeps `copy` (and the home where it was)."""
        if move_home:
            if have.maker is not None and self._flights[have.maker].home_before is None:
                self._flights[have.maker].home_before = page.home
            page.home = have.tier
        if have.maker is None:
            return self._drop(page, copy)
        copy.leaving = True
        self._flights[have.maker].leaving.append(copy)
        return []

    def _replace_stale(self, page: _Page, tier: str) -> tuple[Blocked | None, tuple[Free, ...]]:
        """Make room on `tier` for the current version: drop a stale copy there if the page still fits
        without it (else BudgetExceeded, nothing changed). Blocked if that copy, or an old one still
        draining there, is busy."""
        stale = page.copies.get(tier)
        if (stale is not None and self._busy(stale)) or (page.id, tier) in self._draining:
            return Blocked(page.id, tier), ()
        if stale is None:
            return None, ()
        self._check_fits(page, tier)
        return None, tuple(self._drop(page, stale))

    def _check_fits(self, page: _Page, tier: str) -> None:
        """Refuse (before dropping the stale copy) if the page would not fit on `tier` even without it."""
        budget = self.budgets[tier]
        if budget is None:
            return
        used = self.used(tier)
        need = self._cost(tier, page.nbytes) - self._charged[tier].get(page.id, 0)
        if need > budget - used:
            raise BudgetExceeded(f"tier {tier!r}: page {page.id} ({need} B) does not fit: "
                                 f"{used} B used of a {budget} B budget ({budget - used} B free)")

    def _reserve(self, page: _Page, tier: str) -> None:
        """Charge the page to `tier`, or refuse (BudgetExceeded) with nothing changed."""
        charged = self._charged[tier]
        if page.id in charged:  # cannot happen: the callers check for copies and drains first
            raise PageStoreError(f"tier {tier!r} already holds page {page.id}")
        nbytes, budget, used = self._cost(tier, page.nbytes), self.budgets[tier], self.used(tier)
        if budget is not None and used + nbytes > budget:
            raise BudgetExceeded(f"tier {tier!r}: page {page.id} ({nbytes} B) does not fit: "
                                 f"{used} B used of a {budget} B budget ({budget - used} B free)")
        charged[page.id] = nbytes

    def _start(self, page: _Page, src: _Copy | None, dst_tier: str, leaving: list[_Copy], label: str,
               home_before: str | None = None) -> Move:
        """Record a move whose destination is already reserved."""
        move_id = self._new_id()
        dst = _Copy(self._new_id(), page.id, dst_tier, page.version, self._charged[dst_tier][page.id],
                    maker=move_id)
        move = Move(move_id, page.id, None if src is None else src.tier, dst_tier, page.version,
                    tuple(c.tier for c in leaving), None if src is None else src.id, dst.id, label)
        for c in leaving:
            c.leaving = True
        if src is not None:
            src.readers.add(move_id)
        page.copies[dst_tier] = dst
        self._flights[move_id] = _Flight(move, page, src, dst, list(leaving), home_before)
        return move

    def _new_id(self) -> int:
        self._last_id += 1
        return self._last_id

    def _finish(self, move: Move) -> _Flight:
        try:
            flight = self._flights.pop(move.id)
        except KeyError:
            raise PageStoreError(f"move {move.id} of page {move.page} is not in flight") from None
        flight.dst.maker = None
        return flight

    def _end_read(self, flight: _Flight) -> list[Free]:
        if flight.src is None:
            return []
        flight.src.readers.discard(flight.move.id)
        return self._settle(flight.src)

    def _drop(self, page: _Page, copy: _Copy) -> list[Free]:
        """Forget a copy; its bytes are freed now, or when the last move reading or writing it ends."""
        if page.copies.get(copy.tier) is copy:
            del page.copies[copy.tier]
        if not copy.live:
            return []
        copy.live = copy.leaving = False
        return self._settle(copy)

    def _busy(self, copy: _Copy) -> bool:
        """Whether freeing `copy` has to wait: for moves reading it, and on a tier that must finish a write
        before it can delete it (a file), for the move writing it."""
        return bool(copy.readers) or (copy.maker is not None and copy.tier in self.finish_writes)

    def _settle(self, copy: _Copy) -> list[Free]:
        """Free a dropped, charged copy that no move uses any more; park it as draining while one does."""
        if copy.live or not copy.charged:
            return []
        key = (copy.page, copy.tier)
        if self._busy(copy):
            self._draining[key] = copy
            return []
        if self._draining.get(key) is copy:
            del self._draining[key]
        copy.charged = False
        self._charged[copy.tier].pop(copy.page, None)
        return [Free(copy.page, copy.tier, copy.id)]

    # --- state as data (tests compare states with it) ---------------------------------------------------------
    def snapshot(self) -> tuple:
        """The whole state as nested tuples with the ids left out: two tables in the same state (however their
        ids were numbered) give equal snapshots. Moves appear in the order they were issued."""
        order = {move_id: i for i, move_id in enumerate(self._flights)}

        def copy(c: _Copy | None) -> tuple | None:
            return None if c is None else (c.page, c.tier, c.version, c.cost, order.get(c.maker), c.leaving,
                                           tuple(sorted(order[r] for r in c.readers)), c.live, c.charged)

        pages = tuple((p.id, p.nbytes, p.home, p.version, p.pins, tuple(copy(p.copies[t]) for t in sorted(p.copies)))
                      for _, p in sorted(self._pages.items()))
        drains = tuple(copy(self._draining[k]) for k in sorted(self._draining))
        flights = tuple((f.move.page, f.move.src, f.move.dst, f.move.version, f.move.frees, f.move.label,
                         f.home_before, copy(f.src), copy(f.dst), tuple(copy(c) for c in f.leaving))
                        for f in self._flights.values())
        charged = tuple((t, tuple(sorted(d.items()))) for t, d in self._charged.items())
        return pages, drains, flights, charged
