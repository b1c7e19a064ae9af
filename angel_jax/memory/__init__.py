"""Angel-PTM memory: model state as fixed-size pages across device, pinned host and disk tiers.

- `PageLayout` (layout.py): packs each stage's state pytree into single-dtype flat pages; pack/unpack under jit.
- `Tier`, `DeviceTier`, `HostTier` (tiers.py), `DiskTier` (disk_tier.py): byte-budgeted page holders.
- `PageTable` (page_table.py): the rules of where pages live, as a pure state machine (events in, decisions out).
- `PageStore`, `PageHandle` (store.py): carries out the table's moves; asynchronous prefetch / evict / writeback.
- `bench_io.main` (bench_io.py): `angel-jax bench io`, the bandwidth calibration the scheduling pass reads.

This package knows nothing about models.
"""

from angel_jax.memory.disk_tier import DiskTier
from angel_jax.memory.errors import BudgetExceeded, DiskTierError, PageCorrupted, PagePinned, PageStoreError
from angel_jax.memory.layout import DEFAULT_PAGE_SIZE, LeafSlot, PageLayout, PageSpec, StageLayout
from angel_jax.memory.store import PageHandle, PageStore
from angel_jax.memory.tiers import ArrayTier, DeviceTier, HostTier, Tier, host_memory_kind

__all__ = [
    "DEFAULT_PAGE_SIZE", "PageLayout", "StageLayout", "LeafSlot", "PageSpec",
    "Tier", "ArrayTier", "DeviceTier", "HostTier", "DiskTier", "host_memory_kind",
    "PageStore", "PageHandle",
    "PageStoreError", "BudgetExceeded", "PagePinned", "DiskTierError", "PageCorrupted",
]
