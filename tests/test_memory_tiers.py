"""Array tiers: memory kinds, budgets refused before allocation, accounting equal to jax's live arrays."""

from __future__ import annotations

import collections

import jax
import numpy as np
import pytest

from angel_jax.memory import BudgetExceeded, DeviceTier, HostTier, PageStoreError, host_memory_kind


def live_bytes_by_kind() -> collections.Counter:
    out: collections.Counter = collections.Counter()
    for a in jax.live_arrays():
        out[a.sharding.memory_kind] += a.nbytes
    return out


def test_host_tier_uses_pinned_host_where_the_backend_has_it():
    dev = jax.local_devices()[0]
    kinds = [m.kind for m in dev.addressable_memories()]
    expected = "pinned_host" if "pinned_host" in kinds else ("unpinned_host" if "unpinned_host" in kinds
                                                             else dev.default_memory().kind)
    assert host_memory_kind(dev) == expected
    host = HostTier()
    assert host.memory_kind == expected
    arr = host.put(0, np.arange(16, dtype=np.float32))
    assert arr.sharding.memory_kind == expected
    assert DeviceTier().memory_kind == dev.default_memory().kind
    host.free(0)


def test_put_free_accounting_matches_live_arrays():
    before = live_bytes_by_kind()
    device, host = DeviceTier(), HostTier()
    src = [np.random.default_rng(i).standard_normal(1000 + i).astype(np.float32) for i in range(5)]
    for i, s in enumerate(src):
        device.put(i, s)
        host.put(i, s)
    device.free(1)
    host.free(3)
    jax.block_until_ready([device.get(i) for i in device.page_ids()] + [host.get(i) for i in host.page_ids()])
    after = live_bytes_by_kind()
    assert device.bytes_used == sum(src[i].nbytes for i in (0, 2, 3, 4))
    assert host.bytes_used == sum(src[i].nbytes for i in (0, 1, 2, 4))
    assert after[device.memory_kind] - before[device.memory_kind] == device.bytes_used
    assert after[host.memory_kind] - before[host.memory_kind] == host.bytes_used
    assert device.live_bytes() == device.bytes_used
    np.testing.assert_array_equal(np.asarray(host.get(2)), src[2])
    for t in (device, host):
        for i in t.page_ids():
            t.free(i)
    assert live_bytes_by_kind() == before


def test_budget_is_refused_before_allocating():
    host = HostTier(budget=3 * 4096)
    page = np.zeros(1024, np.float32)  # 4096 B
    for i in range(3):
        host.put(i, page)
    before = live_bytes_by_kind()
    with pytest.raises(BudgetExceeded, match=r"tier 'host': page 3 \(4096 B\) does not fit: 12288 B used of a "
                                             r"12288 B budget"):
        host.put(3, page)
    assert host.bytes_used == 3 * 4096 and not host.holds(3)
    assert live_bytes_by_kind() == before
    host.free(0)
    host.put(3, page)  # fits again once a page is freed
    assert host.bytes_used == 3 * 4096


def test_one_array_per_page_and_adopt_checks_memory():
    device, host = DeviceTier(), HostTier()
    device.put(0, np.ones(8, np.float32))
    with pytest.raises(PageStoreError, match="already holds page 0"):
        device.put(0, np.ones(8, np.float32))
    on_host = jax.device_put(np.ones(8, np.float32), host.sharding)
    with pytest.raises(PageStoreError, match="tier 'device' holds"):
        device.adopt(1, on_host)
    old = device.get(0)
    new = old + 1
    device.adopt(0, new, replace=True)  # replacing deletes the old array: never two copies of a page
    assert old.is_deleted() and device.get(0) is new and device.bytes_used == new.nbytes
    device.free(0)
    assert new.is_deleted() and device.bytes_used == 0
    with pytest.raises(ValueError, match="budget must be >= 0"):
        HostTier(budget=-1)


@pytest.mark.parametrize("tier_cls", [DeviceTier, HostTier])
def test_put_copies_the_callers_buffer(tier_cls):
    """The CPU client aliases page-aligned numpy buffers even with may_alias=False; a tier must not."""
    import mmap

    src = np.frombuffer(mmap.mmap(-1, 1 << 16), np.float32)
    src[:] = np.arange(src.size)
    tier = tier_cls()
    arr = tier.put(0, src)
    arr.block_until_ready()
    src[:] = -1  # the caller reuses its buffer (as the store does with its disk staging buffers)
    np.testing.assert_array_equal(np.asarray(tier.get(0)), np.arange(src.size, dtype=np.float32))
    tier.free(0)


def test_every_tier_implements_the_interface(tmp_path):
    from angel_jax.memory import DiskTier, Tier

    src = np.arange(256, dtype=np.float32)
    for tier in (DeviceTier(), HostTier(), DiskTier(tmp_path)):
        assert isinstance(tier, Tier) and tier.budget is None
        out = tier.put(3, src)
        if hasattr(out, "result"):
            out.result()
        got = tier.get(3)
        np.testing.assert_array_equal(np.asarray(got.result() if hasattr(got, "result") else got), src)
        assert tier.holds(3) and tier.bytes_used == src.nbytes and tier.page_ids() == [3]
        tier.free(3)
        assert not tier.holds(3) and tier.bytes_used == 0
