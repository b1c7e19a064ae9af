"""PageStore: bit-exact moves through every tier, corruption caught on the way up, exact accounting against jax's
live arrays and the files on disk after any sequence of moves, budgets refused, pins honoured, and never two
copies of a page on the device."""

from __future__ import annotations

import collections
import gc
import os
import tempfile

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from angel_jax.memory import (BudgetExceeded, DeviceTier, DiskTier, HostTier, PageCorrupted, PageLayout,
                              PagePinned, PageStore, PageStoreError)

DTYPES = [np.dtype(d) for d in (np.float32, jnp.bfloat16, np.int8, np.uint16, np.bool_, ml_dtypes.float8_e5m2)]


def bits(seed: int, n: int, dtype=np.float32) -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return np.random.default_rng(seed).integers(0, 2, size=n).astype(bool)
    return np.frombuffer(np.random.default_rng(seed).bytes(n * dtype.itemsize), dtype).copy()


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.fixture(autouse=True, scope="module")
def _collections_scan_this_module_only():
    """`check_accounting` collects garbage before it counts arrays, dozens of times per property example. A full
    collection walks every object of the process: late in a suite run, what hundreds of earlier tests left (~0.2 s
    a collection, a minute for this module). What the earlier tests left is frozen instead (gc.freeze: never
    collected, never walked), so a collection here walks what this module made, where any garbage that holds
    the store's arrays comes from."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def arrays_alive_before() -> list:
    """The jax arrays alive now, held so that their ids stay theirs: a test counts the arrays that appeared
    since, whatever earlier tests left alive (or garbage that is collected meanwhile)."""
    return jax.live_arrays()


def live_by_kind(before: list) -> collections.Counter:
    """Bytes per memory kind of the live jax arrays that are not in `before`."""
    old = {id(a) for a in before}
    out: collections.Counter = collections.Counter()
    for a in jax.live_arrays():
        if id(a) not in old:
            out[a.sharding.memory_kind] += a.nbytes
    return out


def _unheld(store: PageStore, before: list, kind: str) -> list[str]:
    """The new live arrays in memory kind `kind` that no tier holds, each with the types of what refers to it."""
    old = {id(a) for a in before}
    held = {id(a) for t in store.tiers.values() for a in getattr(t, "_arrays", {}).values()}
    return [f"{a.dtype}{a.shape} deleted={a.is_deleted()} held by {[type(r).__name__ for r in gc.get_referrers(a)]}"
            for a in jax.live_arrays()
            if id(a) not in old and id(a) not in held and a.sharding.memory_kind == kind]


def check_accounting(store: PageStore, before: list) -> None:
    """Each array tier's bytes equal the bytes of the jax arrays that appeared in its memory kind since `before`
    (the store is the only thing making arrays meanwhile); the disk's equal its files."""
    gc.collect()  # an array only garbage holds (a traceback's frame, say) is not one the store keeps
    live = live_by_kind(before)
    for role in ("device", "host"):
        tier = store.tiers[role]
        assert live[tier.memory_kind] == tier.bytes_used, (role, _unheld(store, before, tier.memory_kind))
        assert tier.live_bytes() == tier.bytes_used
    disk = store.tiers.get("disk")
    if disk is not None:
        assert disk.bytes_used == disk.file_bytes()


@pytest.fixture
def store(tmp_path):
    s = PageStore(DeviceTier(), HostTier(), DiskTier(tmp_path))
    yield s
    s.close()


def test_round_trip_device_host_disk_host_device_is_bit_exact(store):
    values = {i: bits(i, 1000 + 8 * i, dt) for i, dt in enumerate(DTYPES)}
    for i, v in values.items():
        store.add(i, v, home="device")
    for i in values:
        assert store.where(i) == ("device",) and store.home(i) == "device"
    for step, (op, expect_where, expect_home) in enumerate([
            (lambda i: store.evict(i, "device"), ("host",), "host"),
            (lambda i: store.evict(i, "host"), ("disk",), "disk"),
            (lambda i: store.prefetch(i, "host"), ("host", "disk"), "disk"),
            (lambda i: store.prefetch(i, "device"), ("device", "disk"), "disk")]):
        handles = [op(i) for i in values]  # all pages in flight together
        for h in handles:
            h.wait()
        for i in values:
            assert store.where(i) == expect_where and store.home(i) == expect_home, (step, i)
    for i, v in values.items():  # the host copy was a staging copy: moving on freed it
        arr = store.get(i)
        assert arr.sharding.memory_kind == store.tiers["device"].memory_kind
        assert same_bits(arr, v)
    assert store.bytes_used()["host"] == 0


def test_corrupted_page_is_detected_on_the_way_up_and_nothing_changes(store):
    store.add(5, bits(5, 4096), home="disk").wait()
    store.add(6, bits(6, 4096), home="disk").wait()
    path = store.tiers["disk"].chunk_path(5)
    with open(path, "r+b") as f:
        f.seek(1234)
        b = f.read(1)
        f.seek(1234)
        f.write(bytes([b[0] ^ 1]))
    before_live, before = arrays_alive_before(), store.bytes_used()
    bad, good = store.prefetch(5, "device"), store.prefetch(6, "device")
    with pytest.raises(PageCorrupted, match=rf"page 5 is corrupted on disk: XXH3-64 of {path}"):
        bad.wait()
    good.wait()
    assert store.where(5) == ("disk",) and store.where(6) == ("device", "disk")
    assert store.bytes_used()["device"] == before["device"] + 4096 * 4
    assert live_by_kind(before_live)["device"] == 4096 * 4
    with pytest.raises(PageStoreError, match="page 5 has no current copy on 'device'"):
        store.get(5)
    assert [type(e) for e in store.wait_all()] == [PageCorrupted]


def test_budget_refused_at_issue_changes_nothing(tmp_path):
    s = PageStore(DeviceTier(budget=2 * 4096), HostTier(budget=3 * 4096), DiskTier(tmp_path, budget=4096))
    for i in range(3):
        s.add(i, bits(i, 1024), home="host").wait()
    with pytest.raises(BudgetExceeded, match="tier 'host'"):
        s.add(3, bits(3, 1024), home="host")
    s.prefetch(0).wait()
    s.prefetch(1).wait()
    live, used = arrays_alive_before(), s.bytes_used()
    with pytest.raises(BudgetExceeded, match=r"tier 'device': page 2 \(4096 B\) does not fit: 8192 B used"):
        s.prefetch(2)
    assert s.where(2) == ("host",) and s.bytes_used() == used and live_by_kind(live) == collections.Counter()
    s.evict(2, "host").wait()  # host -> disk (1 page budget)
    with pytest.raises(BudgetExceeded, match="tier 'disk'"):
        s.evict(1, "host")
    assert s.where(1) == ("device", "host") and s.home(1) == "host" and s.bytes_used()["disk"] == 4096
    s.evict(0).wait()
    s.prefetch(2).wait()  # disk -> device now fits
    assert same_bits(s.get(2), bits(2, 1024))
    s.close()


def test_pins_block_eviction_and_keep_the_device_copy(store):
    store.add(0, bits(0, 256), home="disk").wait()
    store.prefetch(0, "device").wait()
    with store.pinned([0]):
        with pytest.raises(PagePinned, match="page 0 is pinned on the device"):
            store.evict(0, "device")
        store.prefetch(0, "host").wait()  # a copy down does not free a pinned device copy
        assert store.where(0) == ("device", "host", "disk")
    store.evict(0, "device").wait()
    assert store.where(0) == ("host", "disk")
    with pytest.raises(PageStoreError, match="not pinned"):
        store.unpin(0)


def test_never_two_device_copies_and_update_writes_back(store):
    v = bits(1, 2048)
    store.add(1, v, home="host").wait()
    store.prefetch(1).wait()
    first = store.get(1)
    assert store.prefetch(1).wait().done()  # already there: no second copy
    assert store.get(1) is first and store.bytes_used()["device"] == v.nbytes
    new = jax.jit(lambda x: x * 2)(first)
    expected = np.asarray(new).copy()
    store.update(1, new)
    assert first.is_deleted() and store.get(1) is new
    assert store.is_dirty(1) and store.where(1) == ("device",)  # the stale home copy is not current
    assert store.bytes_used()["host"] == v.nbytes  # ... but still held until replaced
    store.writeback(1).wait()
    assert not store.is_dirty(1) and store.where(1) == ("device", "host")
    assert same_bits(np.asarray(store.tiers["host"].get(1)), expected)
    newer = store.get(1) + 1
    expected = np.asarray(newer).copy()
    store.update(1, newer)
    store.evict(1).wait()  # dirty device copy: evicting writes it home first
    assert store.where(1) == ("host",) and same_bits(store.read(1), expected)
    assert newer.is_deleted() and store.bytes_used()["device"] == 0
    with pytest.raises(PageStoreError, match="update must be float32"):
        store.prefetch(1).wait()
        store.update(1, jnp.zeros(3, jnp.float32))


def test_chained_moves_without_waiting(store):
    before = arrays_alive_before()
    values = {i: bits(10 + i, 512) for i in range(6)}
    for i, v in values.items():
        store.add(i, v, home="host")
    for i in values:  # issue a whole schedule before anything completes
        store.evict(i, "host")        # -> disk, home disk
        store.prefetch(i, "device")   # disk -> device, chained on the write
        store.prefetch(i, "host")     # device -> host: the device copy is not home, so it goes
    with pytest.raises(PageStoreError, match="page 0 is not on 'device'"):
        store.evict(0, "device")      # already leaving
    store.evict(1, "host")            # host -> nothing: disk (home) holds it
    store.prefetch(2, "device")       # host -> device while host still lands
    assert store.wait_all() == []
    for i, v in values.items():
        assert store.home(i) == "disk" and same_bits(store.read(i), v)
    assert store.where(0) == ("host", "disk") and store.where(1) == ("disk",)
    assert store.where(2) == ("device", "disk")  # the host copy was staging: moving it up freed it
    check_accounting(store, before)


# --- any sequence of moves ------------------------------------------------------------------------------------------
ops = st.lists(st.tuples(st.sampled_from(["prefetch_device", "prefetch_host", "evict_device", "evict_host",
                                          "writeback", "update", "pin", "unpin", "wait"]),
                         st.integers(0, 4)), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                    HealthCheck.function_scoped_fixture])
@given(ops, st.sampled_from(["host", "disk", "device"]))
def test_accounting_and_values_after_any_sequence_of_moves(sequence, home):
    before = arrays_alive_before()
    page_bytes = 1024 * 4
    with tempfile.TemporaryDirectory() as d:
        s = PageStore(DeviceTier(budget=3 * page_bytes), HostTier(budget=6 * page_bytes), DiskTier(d))
        expected = {}
        for i in range(5):
            expected[i] = bits(i, 1024)
            target = home if home != "device" or i < 3 else "host"
            s.add(i, expected[i], home=target)
        for op, i in sequence:
            used = s.bytes_used()
            try:
                if op == "prefetch_device":
                    s.prefetch(i, "device")
                elif op == "prefetch_host":
                    s.prefetch(i, "host")
                elif op.startswith("evict"):
                    s.evict(i, op.split("_")[1])
                elif op == "writeback":
                    s.writeback(i)
                elif op == "update":
                    cur = s.get(i, "device")
                    new = jax.device_put((np.asarray(cur).view(np.uint32) + 1).view(np.float32), cur.sharding)
                    expected[i] = np.asarray(new).copy()
                    s.update(i, new)
                elif op == "pin":
                    s.pin(i)
                elif op == "unpin":
                    s.unpin(i)
                else:
                    assert s.wait_all() == []
                    check_accounting(s, before)
            except BudgetExceeded:
                # Refused: nothing reserved. (Moves issued earlier may land meanwhile and free their sources, on
                # their own threads, so usage can only have dropped; it was once compared for equality, which
                # failed when a free landed between the two readings.)
                after = s.bytes_used()
                assert all(after[t] <= used[t] for t in used), (used, after)
            except PageStoreError:
                pass  # e.g. evicting a page that is not there; must leave the store consistent
            for t in ("device", "host"):
                budget = s.tiers[t].budget
                assert s.tiers[t].bytes_used <= budget
        assert s.wait_all() == []
        check_accounting(s, before)
        for i, v in expected.items():
            assert same_bits(s.read(i), v), i
            assert s.home(i) in s.where(i) or s.is_dirty(i)
        # Nothing lingers: the device holds exactly the pages whose current copy is there (one array each);
        # the host those plus stale home copies of dirty pages.
        on = {t: {i for i in expected if t in s.where(i)} for t in ("device", "host", "disk")}
        assert set(s.tiers["device"].page_ids()) == on["device"]
        stale_home = {i for i in expected if s.is_dirty(i) and s.home(i) == "host"}
        assert set(s.tiers["host"].page_ids()) == on["host"] | stale_home
        s.close()
        assert s.bytes_used() == {"device": 0, "host": 0, "disk": 0}
    assert live_by_kind(before) == collections.Counter()


@pytest.mark.compares_programs
def test_stage_pages_through_the_store_into_a_jitted_stage(store):
    rng = np.random.default_rng(3)
    params = {"w": rng.standard_normal((64, 32)).astype(np.float32), "b": rng.standard_normal(32).astype(np.float32),
              "scale": np.ones(32, jnp.bfloat16)}
    layout = PageLayout.build([("block", params)], page_size_bytes=2048)
    stage = layout.stage("block")
    for pid, page in zip(stage.page_ids, stage.pack(params)):
        store.add(pid, page, home="disk")
    for h in [store.prefetch(pid) for pid in stage.page_ids]:
        h.wait()

    @jax.jit
    def step(pages, x):
        p = stage.unpack(pages)
        y = (x @ p["w"] + p["b"]) * p["scale"].astype(jnp.float32)
        p = {**p, "b": p["b"] + y.mean(0)}
        return y, stage.pack(p)

    x = rng.standard_normal((4, 64)).astype(np.float32)
    with store.pinned(stage.page_ids):
        y, new_pages = step(tuple(store.get(pid) for pid in stage.page_ids), x)
        for pid, page in zip(stage.page_ids, new_pages):
            store.update(pid, page)
    for h in [store.evict(pid) for pid in stage.page_ids]:
        h.wait()
    back = stage.unpack([store.read(pid) for pid in stage.page_ids])
    ref_y = x @ params["w"] + params["b"]
    np.testing.assert_allclose(np.asarray(y), ref_y, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(back["b"], params["b"] + np.asarray(y).mean(0), rtol=1e-5, atol=1e-5)
    assert same_bits(back["w"], params["w"])
    assert all(store.where(pid) == ("disk",) for pid in stage.page_ids)
    assert os.path.isfile(store.tiers["disk"].chunk_path(stage.page_ids[0]))


def test_finished_moves_leave_no_page_array_to_the_cyclic_collector(store):
    """A page copy freed by a move is freed then, by reference counting: nothing of it waits in a reference cycle
    for Python's collector (which runs rarely; with large pages, the garbage it waits for grows to gigabytes)."""
    import gc

    shape = (4099,)  # a length no other array in the process has, to tell the pages' arrays apart
    for i in range(4):
        store.add(i, bits(i, shape[0]), home="host")
    gc.collect()
    gc.disable()
    try:
        for _ in range(2):
            for i in range(4):  # host -> disk -> device (dropped) -> host, a new version there, written home
                store.evict(i, "host").wait()
                store.prefetch(i, "device").wait()
                store.evict(i, "device").wait()
                store.prefetch(i, "host").wait()
                store.put(i, jax.device_put(bits(20 + i, shape[0]), store.tiers["host"].sharding), "host")
        assert store.wait_all() == []
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        cyclic = [o for o in gc.garbage if isinstance(o, (jax.Array, np.ndarray)) and getattr(o, "shape", ()) == shape]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
        gc.collect()
    assert cyclic == [], f"{len(cyclic)} page arrays were left in reference cycles"


def test_discard_lets_go_of_a_clean_staging_copy_only(store):
    """`discard` frees a staged copy whose bytes the home tier holds, and leaves alone a newer version installed
    on that tier meanwhile (the next step's gradients in the pages the last update read)."""
    host = store.tiers["host"].sharding
    store.add(0, bits(0, 256), home="disk")
    store.prefetch(0, "host").wait()
    assert store.where(0) == ("host", "disk")
    store.discard(0, "host").wait()
    assert store.where(0) == ("disk",) and store.bytes_used()["host"] == 0
    assert store.discard(0, "host") is None  # gone already
    store.prefetch(0, "host").wait()
    newer = bits(1, 256)
    store.put(0, jax.device_put(newer, host), "host")  # a new version on the host; the disk copy is stale
    assert store.discard(0, "host") is None and store.where(0) == ("host",)
    store.evict(0, "host").wait()  # its owner writes it home
    assert store.where(0) == ("disk",) and same_bits(store.read(0), newer)
