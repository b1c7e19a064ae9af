"""PageTable, the pure bookkeeping under PageStore: every reachable state after any short sequence of events keeps
the invariants, refusals change nothing, failures roll back, and the frees it asks for match the reservations a
mover makes; plus exact decisions for the cases the store's docstring promises. No jax, no threads: events only."""

from __future__ import annotations

import copy

import pytest

from angel_jax.memory.errors import BudgetExceeded, PagePinned, PageStoreError
from angel_jax.memory.page_table import Blocked, Decision, Free, Installed, Move, PageTable, Present

TIERS = ("device", "host", "disk")


class Mirror:
    """What a mover's tiers hold if it carries out every decision: a reservation per Move, a release per Free.
    Any double reservation or free of something not held is a broken contract."""

    def __init__(self) -> None:
        self.held: dict[str, dict[int, int]] = {t: {} for t in TIERS}

    def apply(self, table: PageTable, d: Decision) -> None:
        for f in d.frees:
            assert f.page in self.held[f.tier], f"free of {f} that is not held"
            del self.held[f.tier][f.page]
        a = d.action
        if isinstance(a, Move):
            assert a.page not in self.held[a.dst], f"{a} reserves a slot already held"
            self.held[a.dst][a.page] = table.charged(a.dst)[a.page]
        elif isinstance(a, Installed):
            assert a.page in self.held[a.tier]

    def check(self, table: PageTable) -> None:
        for t in table.tiers:
            assert self.held[t] == table.charged(t), t


PAGE_BYTES = {0: 1, 1: 2}


def check_invariants(table: PageTable) -> None:
    """What must hold between any two events, read through the table's queries."""
    moves = table.in_flight()
    for tier in table.tiers:
        expect = {pid: PAGE_BYTES[pid] for pid in table.page_ids() if tier in table.copies(pid)}
        for (pid, t), cid in table.draining().items():
            if t == tier:  # a dropped copy still charged: some move still reads it (or, on the disk, writes it)
                assert pid not in expect, f"page {pid}: a copy and a draining copy on {tier!r}"
                expect[pid] = PAGE_BYTES[pid]
                assert any(m.src_copy == cid or (m.dst_copy == cid and t in table.finish_writes) for m in moves)
        assert table.charged(tier) == expect, tier  # exact accounting: every copy counted once, nothing else
        budget = table.budgets[tier]
        assert budget is None or table.used(tier) <= budget, (tier, table.used(tier), budget)
    for pid in table.page_ids():
        copies, version, home = table.copies(pid), table.version(pid), table.home(pid)
        assert any(c.version == version for c in copies.values()), f"page {pid}: its current version is lost"
        for tier, c in copies.items():
            assert c.version == version or tier == home or c.leaving, f"page {pid}: stale copy on {tier!r}"
            assert c.in_flight == any(m.dst_copy == c.id for m in moves), (pid, tier)


def make(budgets=None) -> tuple[PageTable, Mirror]:
    """Page 0 (1 B) homed on the host, page 1 (2 B) on the disk, both landed; tight budgets so that refusals
    happen: the device and the host hold 2 B each (not both pages)."""
    table, mirror = PageTable(budgets or {"device": 2, "host": 2, "disk": 3}), Mirror()
    for pid, nbytes, home in ((0, 1, "host"), (1, 2, "disk")):
        d = table.add(pid, nbytes, home)
        mirror.apply(table, d)
        mirror.apply(table, table.landed(d.action))
    return table, mirror


def page_events(pages=(0, 1)) -> list[tuple]:
    out: list[tuple] = []
    for p in pages:
        out += [("prefetch", p, t) for t in TIERS] + [("evict", p, t) for t in TIERS]
        out += [("writeback", p), ("update", p, "device"), ("update", p, "host")]
    return out + [("pin", 0), ("unpin", 0)]


FLIGHT_EVENTS = [("landed", 0), ("landed", -1), ("failed", 0), ("failed", -1)]


def apply(table: PageTable, event: tuple) -> Decision | None:
    """Apply one event; None when it does not apply (no move in flight to complete)."""
    kind = event[0]
    if kind in ("landed", "failed"):
        moves = table.in_flight()
        if not moves:
            return None
        return getattr(table, kind)(moves[event[1]])
    if kind in ("pin", "unpin"):
        getattr(table, kind)(event[1])
        return Decision()
    return getattr(table, kind)(*event[1:])


def step(table: PageTable, mirror: Mirror, event: tuple, failed_before: bool) -> bool | None:
    """Apply `event` and check everything that must hold after it. Returns whether any move failed so far, or
    None if the event did not apply."""
    before = table.snapshot()
    moves_before = table.in_flight()
    try:
        d = apply(table, event)
    except (BudgetExceeded, PagePinned, PageStoreError):
        assert table.snapshot() == before, f"refused {event} changed the state"
        return failed_before
    if d is None:
        return None
    if isinstance(d.action, Blocked):
        assert table.snapshot() == before and not d.frees, f"blocked {event} changed the state"
    mirror.apply(table, d)
    check_invariants(table)
    mirror.check(table)
    failed = failed_before or event[0] == "failed"
    if event[0] == "failed":
        move = moves_before[event[1]]
        assert move not in table.in_flight()
        page_ids = table.page_ids()
        if move.page in page_ids:  # the destination is gone, whatever happened meanwhile
            assert move.dst_copy not in {c.id for c in table.copies(move.page).values()}
    if event[0] == "landed":
        move = moves_before[event[1]]
        live = move.page in table.page_ids() and table.copies(move.page).get(move.dst)
        if live and live.id == move.dst_copy:  # unless dropped meanwhile, the destination is complete
            assert not live.in_flight
    if not failed:
        for pid in table.page_ids():  # the home copy exists, stale or landing, unless a move failed
            assert table.home(pid) in table.copies(pid), (pid, table.copies(pid))
    if isinstance(d.action, Move) and event[0] not in ("landed", "failed"):
        check_immediate_failure(table, d, before)
    return failed


def check_immediate_failure(table: PageTable, d: Decision, before: tuple) -> None:
    """A move that fails at once leaves the state it started from, except for a stale copy it replaced (whose
    data was freed to make room; a move still writing it carries on, writing a copy that is gone)."""
    t2 = copy.deepcopy(table)
    t2.failed(d.action)
    check_invariants(t2)
    after = t2.snapshot()
    replaced = {(f.page, f.tier) for f in d.frees}
    pages, drains, flights, charged = before
    pages = tuple((*p[:5], tuple(c for c in p[5] if (c[0], c[1]) not in replaced)) for p in pages)
    charged = tuple((t, tuple((pid, n) for pid, n in items if (pid, t) not in replaced)) for t, items in charged)
    assert after[0] == pages and after[1] == drains and after[3] == charged
    assert [f[:7] for f in after[2]] == [f[:7] for f in flights]  # the same moves in flight
    if not replaced:
        assert after == before


def explore(events: list[tuple], depth: int) -> int:
    """Breadth-first over the distinct states reachable in `depth` events (every sequence up to that length
    passes through one of them); checks every transition. Returns how many transitions were checked."""
    table, mirror = make()
    frontier = {(table.snapshot(), False): (table, mirror)}
    seen = set(frontier)
    checked = 0
    for _ in range(depth):
        nxt = {}
        for (_, failed), (table, mirror) in frontier.items():
            for event in events:
                t, m = copy.deepcopy((table, mirror))
                now = step(t, m, event, failed)
                if now is None:
                    continue
                checked += 1
                key = (t.snapshot(), now)
                if key not in seen:
                    seen.add(key)
                    nxt[key] = (t, m)
        frontier = nxt
    return checked


def test_every_sequence_of_six_events_on_one_page_keeps_the_invariants():
    n = explore(page_events((0,)) + FLIGHT_EVENTS, depth=6)
    assert n > 10000  # transitions checked, from distinct states


def test_every_sequence_of_four_events_on_two_pages_keeps_the_invariants():
    n = explore(page_events() + FLIGHT_EVENTS, depth=4)
    assert n > 3000


# --- exact decisions ----------------------------------------------------------------------------------------------
UNLIMITED = {"device": None, "host": None, "disk": None}


def test_prefetch_from_home_keeps_the_source_and_from_a_staging_copy_frees_it():
    table, _ = make(UNLIMITED)
    d = table.prefetch(1, "host")
    assert d.action == Move(d.action.id, 1, "disk", "host", 0, (), d.action.src_copy, d.action.dst_copy,
                            "prefetch disk->host")
    assert table.where(1) == ("host", "disk") and table.used("host") == 3
    table.landed(d.action)
    d = table.prefetch(1, "device")
    assert (d.action.src, d.action.dst, d.action.frees) == ("host", "device", ("host",))
    assert table.where(1) == ("device", "disk")  # the host copy is leaving: not current any more
    assert table.landed(d.action).frees == (Free(1, "host", d.action.src_copy),)
    assert table.charged("host") == {0: 1} and table.charged("device") == {1: 2}


def test_a_pinned_device_copy_is_never_freed_by_a_move():
    table, _ = make()
    table.landed(table.prefetch(0, "device").action)
    table.pin(0)
    with pytest.raises(PagePinned, match=r"page 0 is pinned on the device \(1x\); it cannot be evicted"):
        table.evict(0, "device")
    table.landed(table.evict(0, "host").action)  # host -> disk: home moves down
    assert table.home(0) == "disk"
    d = table.prefetch(0, "host")
    assert d.action.src == "device" and d.action.frees == ()
    table.unpin(0)
    with pytest.raises(PageStoreError, match="page 0 is not pinned"):
        table.unpin(0)


def test_budget_refusal_names_the_numbers_and_changes_nothing():
    table, _ = make()
    table.landed(table.prefetch(1, "device").action)
    before = table.snapshot()
    with pytest.raises(BudgetExceeded, match=r"^tier 'device': page 0 \(1 B\) does not fit: 2 B used of a "
                                             r"2 B budget \(0 B free\)$"):
        table.prefetch(0, "device")
    with pytest.raises(BudgetExceeded, match=r"^tier 'host': page 1 \(2 B\) does not fit: 1 B used of a 2 B "
                                             r"budget \(1 B free\)$"):
        table.prefetch(1, "host")
    assert table.snapshot() == before


def test_update_leaves_a_stale_home_until_writeback_and_writeback_replaces_it():
    table, mirror = make()
    mirror.apply(table, d := table.prefetch(0, "device"))
    mirror.apply(table, table.landed(d.action))
    d = table.update(0, "device")
    assert isinstance(d.action, Installed) and d.frees == ()
    assert table.is_dirty(0) and table.where(0) == ("device",) and table.copies(0)["host"][1:] == (0, False, False)
    mirror.apply(table, d := table.writeback(0))
    assert (d.action.src, d.action.dst, d.action.version) == ("device", "host", 1)
    assert [f.tier for f in d.frees] == ["host"]  # the stale copy made room for the new one
    mirror.apply(table, table.landed(d.action))
    assert not table.is_dirty(0) and table.where(0) == ("device", "host")
    mirror.check(table)
    assert isinstance(table.writeback(0).action, Present)


def test_failed_eviction_of_the_home_copy_restores_the_home():
    table, mirror = make({"device": None, "host": None, "disk": None})
    mirror.apply(table, d := table.evict(0, "host"))
    assert table.home(0) == "disk" and table.where(0) == ("disk",)
    mirror.apply(table, table.failed(d.action))
    assert table.home(0) == "host" and table.where(0) == ("host",) and table.charged("disk") == {1: 2}
    mirror.check(table)


def test_a_stale_home_copy_still_being_read_blocks_its_replacement_until_the_read_ends():
    table, mirror = make(UNLIMITED)
    mirror.apply(table, d := table.prefetch(0, "device"))
    mirror.apply(table, table.landed(d.action))
    mirror.apply(table, down := table.prefetch(0, "disk"))    # host (home) -> disk, reading the host copy
    assert (down.action.src, down.action.frees) == ("host", ())
    mirror.apply(table, table.update(0, "device"))            # the disk copy (being written) is dropped: drains
    assert table.draining().keys() == {(0, "disk")} and table.charged("disk") == {0: 1, 1: 2}
    assert isinstance(table.writeback(0).action, Blocked)      # the stale home copy is still being read
    assert isinstance(table.prefetch(0, "disk").action, Blocked)
    mirror.apply(table, table.landed(down.action))             # ...until that move ends
    assert not table.draining() and table.charged("disk") == {1: 2}
    mirror.apply(table, d := table.writeback(0))
    assert (d.action.src, d.action.dst, d.action.version) == ("device", "host", 1) and len(d.frees) == 1
    mirror.check(table)


@pytest.mark.parametrize("lands", [True, False])
def test_evicting_to_a_copy_still_landing_keeps_the_source_until_it_lands(lands):
    table, mirror = make(UNLIMITED)
    mirror.apply(table, d := table.prefetch(0, "device"))
    mirror.apply(table, table.landed(d.action))
    mirror.apply(table, table.update(0, "device"))
    mirror.apply(table, w := table.writeback(0))              # device -> host, the new version
    mirror.apply(table, e := table.evict(0, "device"))        # the host copy is current: nothing to move
    assert isinstance(e.action, Present) and e.frees == () and table.where(0) == ("host",)
    assert table.copies(0)["device"].leaving
    mirror.apply(table, (table.landed if lands else table.failed)(w.action))
    assert table.where(0) == (("host",) if lands else ("device",))  # a failed write loses nothing
    mirror.check(table)
    check_invariants(table)


@pytest.mark.parametrize("land_first", [False, True])
def test_prefetching_a_leaving_copy_ends_in_the_same_state_whatever_the_timing(land_first):
    table, mirror = make({"device": None, "host": None, "disk": None})
    mirror.apply(table, d := table.prefetch(1, "device"))      # disk (home) -> device
    mirror.apply(table, table.landed(d.action))
    mirror.apply(table, away := table.prefetch(1, "host"))     # device -> host: the device copy leaves
    if land_first:
        mirror.apply(table, table.landed(away.action))
        mirror.apply(table, d := table.prefetch(1, "device"))  # a real move back: host -> device
        assert d.action.frees == ("host",)
        mirror.apply(table, table.landed(d.action))
    else:
        mirror.apply(table, d := table.prefetch(1, "device"))  # claimed back before the move lands
        assert isinstance(d.action, Present)
        mirror.apply(table, table.landed(away.action))
    assert table.where(1) == ("device", "disk") and not table.in_flight() and not table.draining()
    assert table.charged("host") == {0: 1} and table.charged("device") == {1: 2}
    mirror.check(table)
    check_invariants(table)


def test_removing_a_page_with_a_move_in_flight_frees_its_copies_when_the_move_ends():
    table, mirror = make()
    mirror.apply(table, d := table.prefetch(1, "device"))
    mirror.apply(table, r := table.remove(1))
    # the device copy (a transfer in flight) goes at once, the disk copy it reads from once the read ends
    assert [(f.page, f.tier) for f in r.frees] == [(1, "device")] and table.draining().keys() == {(1, "disk")}
    mirror.apply(table, table.failed(d.action))
    assert not table.draining() and table.charged("disk") == {} and table.charged("device") == {}
    mirror.check(table)
    with pytest.raises(PageStoreError, match="page 1 is not in the store"):
        table.prefetch(1, "device")

