"""Tiers: where a page can live. One interface (`Tier`), three implementations:

- `DeviceTier`: page arrays in accelerator memory (`memory_kind='device'`).
- `HostTier`: page arrays in `pinned_host` memory (DMA-able, so `jax.device_put` to and from the device is an
  asynchronous copy on the transfer streams). Backends without `pinned_host` fall back to `unpinned_host`, then to
  the default memory (see `host_memory_kind`); the CPU backend has all three kinds, all in host RAM.
- `DiskTier` (disk_tier.py): a tensorstore zarr3 array, one chunk per page.

A tier holds at most one array per page id, has a byte budget (None = unlimited) and exact accounting: `bytes_used`
is the sum of what it holds, counting a page from the moment it is reserved (a transfer in flight) until it is freed.
A put that would exceed the budget raises `BudgetExceeded` before anything is allocated.

Tiers are passive: they neither move pages between each other nor decide anything; `PageStore` does that.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import Any

import jax
import numpy as np

from angel_jax.memory.errors import BudgetExceeded, PageStoreError

HOST_MEMORY_KINDS = ("pinned_host", "unpinned_host")


class Tier(ABC):
    """A byte-budgeted home for pages, keyed by global page id."""

    def __init__(self, name: str, budget: int | None):
        if budget is not None and budget < 0:
            raise ValueError(f"tier {name!r}: budget must be >= 0 or None (unlimited), got {budget}")
        self.name = name
        self.budget = budget
        self._bytes: dict[int, int] = {}
        self._lock = threading.RLock()

    # --- accounting -------------------------------------------------------------------------------------------
    @property
    def bytes_used(self) -> int:
        with self._lock:
            return sum(self._bytes.values())

    @property
    def bytes_free(self) -> int | None:
        return None if self.budget is None else self.budget - self.bytes_used

    def holds(self, page_id: int) -> bool:
        with self._lock:
            return page_id in self._bytes

    def page_ids(self) -> list[int]:
        with self._lock:
            return sorted(self._bytes)

    def charged(self, page_id: int) -> int:
        """Bytes this tier counts for the page (0 if it does not hold it)."""
        with self._lock:
            return self._bytes.get(page_id, 0)

    def page_bytes(self, nbytes: int) -> int:
        """What a page of `nbytes` costs on this tier."""
        return nbytes

    def reserve(self, page_id: int, nbytes: int) -> None:
        """Count `nbytes` for a page about to arrive; refuse (nothing changes) if over budget or already held."""
        with self._lock:
            if page_id in self._bytes:
                raise PageStoreError(f"tier {self.name!r} already holds page {page_id}")
            used = sum(self._bytes.values())
            if self.budget is not None and used + nbytes > self.budget:
                raise BudgetExceeded(f"tier {self.name!r}: page {page_id} ({nbytes} B) does not fit: "
                                     f"{used} B used of a {self.budget} B budget ({self.budget - used} B free)")
            self._bytes[page_id] = nbytes

    def release(self, page_id: int) -> None:
        """Stop counting a page (after it was freed, or when a reserved transfer failed)."""
        with self._lock:
            self._bytes.pop(page_id, None)

    def stats(self) -> dict[str, Any]:
        return {"tier": self.name, "bytes_used": self.bytes_used, "budget": self.budget,
                "pages": len(self._bytes)}

    # --- data ---------------------------------------------------------------------------------------------------
    @abstractmethod
    def put(self, page_id: int, src: Any, reserved: bool = False) -> Any:
        """Start storing a page (asynchronously); array tiers return the jax.Array, the disk a future."""

    @abstractmethod
    def get(self, page_id: int) -> Any:
        """The page: array tiers return the held jax.Array, the disk a future of a numpy array."""

    @abstractmethod
    def free(self, page_id: int) -> None:
        """Drop the tier's copy of a page and its bytes."""


def page_sharding(device: jax.Device, memory_kind: str, over: jax.sharding.Mesh | None = None
                  ) -> jax.sharding.Sharding:
    """Where an array tier's pages live: `device`'s `memory_kind`, or split evenly over the 1-D mesh `over`."""
    if over is None:
        return jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind)
    (axis,) = over.axis_names
    return jax.sharding.NamedSharding(over, jax.sharding.PartitionSpec(axis), memory_kind=memory_kind)


class ArrayTier(Tier):
    """Pages as 1-D `jax.Array`s in one memory kind of one device, or, given `over` (a 1-D mesh), sharded evenly
    over its devices (ZeRO-3 pages: each device holds its rank's shard of every page; `bytes_used` and the budget
    count the pages' global bytes, N times a rank's)."""

    def __init__(self, name: str, memory_kind: str, device: jax.Device | None = None, budget: int | None = None,
                 over: jax.sharding.Mesh | None = None):
        super().__init__(name, budget)
        if over is not None:
            device = over.devices.flat[0]
        self.device = device if device is not None else jax.local_devices()[0]
        kinds = [m.kind for m in self.device.addressable_memories()]
        if memory_kind not in kinds:
            raise PageStoreError(f"tier {name!r}: device {self.device} has no memory kind {memory_kind!r} "
                                 f"(it has {kinds})")
        self.memory_kind = memory_kind
        self.sharding: jax.sharding.Sharding = page_sharding(self.device, memory_kind, over)
        self._arrays: dict[int, jax.Array] = {}

    def put(self, page_id: int, src: jax.Array | np.ndarray, reserved: bool = False) -> jax.Array:
        """Start copying `src` into this tier (asynchronous: `jax.device_put`) and hold the result. The caller
        owns `src` and frees it when the copy is done (donation across memory kinds is not implemented).
        `reserved`: the bytes were already reserved with `reserve` (a transfer whose source was not ready)."""
        if not reserved:
            self.reserve(page_id, int(src.nbytes))
        try:
            if isinstance(src, np.ndarray) and self.device.platform == "cpu":
                # The CPU client aliases a suitably aligned numpy buffer instead of copying it, even with
                # may_alias=False (jax 0.11): the page would change with the caller's buffer. Copy first.
                src = np.array(src, copy=True)
            arr = jax.device_put(src, self.sharding)
        except Exception:
            self.release(page_id)
            raise
        with self._lock:
            self._arrays[page_id] = arr
        return arr

    def adopt(self, page_id: int, arr: jax.Array, replace: bool = False) -> None:
        """Hold an array already in this tier's memory (e.g. a stage's output). With `replace`, the previous
        array of the page is deleted first, so the tier never holds two arrays of one page."""
        self.check_resident(page_id, arr)
        with self._lock:
            if replace and page_id in self._arrays:
                old = self._arrays.pop(page_id)
                if old is not arr and not old.is_deleted():
                    old.delete()
                self.release(page_id)
            self.reserve(page_id, int(arr.nbytes))
            self._arrays[page_id] = arr

    def check_resident(self, page_id: int, arr: jax.Array) -> None:
        if not isinstance(arr, jax.Array):
            raise PageStoreError(f"page {page_id}: expected a jax.Array for tier {self.name!r}, got {type(arr)}")
        kind = arr.sharding.memory_kind
        if not arr.sharding.is_equivalent_to(self.sharding, arr.ndim) or kind != self.memory_kind:
            raise PageStoreError(f"page {page_id}: array lives on {arr.sharding} in {kind!r}, tier {self.name!r} "
                                 f"holds {self.sharding} {self.memory_kind!r}")

    def get(self, page_id: int) -> jax.Array:
        with self._lock:
            try:
                return self._arrays[page_id]
            except KeyError:
                raise PageStoreError(f"tier {self.name!r} does not hold page {page_id}") from None

    def free(self, page_id: int) -> None:
        with self._lock:
            arr = self._arrays.pop(page_id, None)
            self.release(page_id)
        if arr is not None and not arr.is_deleted():
            arr.delete()

    def live_bytes(self) -> int:
        """Bytes of the held arrays that jax still considers live (equals `bytes_used` when nothing is in
        flight and no caller deleted a held array behind the tier's back)."""
        with self._lock:
            return sum(a.nbytes for a in self._arrays.values() if not a.is_deleted())


class DeviceTier(ArrayTier):
    """Page arrays in device memory (HBM on a GPU)."""

    def __init__(self, device: jax.Device | None = None, budget: int | None = None, name: str = "device",
                 over: jax.sharding.Mesh | None = None):
        if over is not None:
            device = over.devices.flat[0]
        device = device if device is not None else jax.local_devices()[0]
        super().__init__(name, device.default_memory().kind, device, budget, over)


def host_memory_kind(device: jax.Device) -> str:
    """The memory kind the host tier uses on `device`: `pinned_host` where the backend offers it (DMA-able, the
    point of the host tier), else `unpinned_host`, else the device's default memory (a backend with a single
    memory kind, where 'host' and 'device' pages then share one pool)."""
    kinds = [m.kind for m in device.addressable_memories()]
    for kind in HOST_MEMORY_KINDS:
        if kind in kinds:
            return kind
    return device.default_memory().kind


class HostTier(ArrayTier):
    """Page arrays in pinned host memory (see `host_memory_kind` for the fallback)."""

    def __init__(self, device: jax.Device | None = None, budget: int | None = None,
                 memory_kind: str | None = None, name: str = "host", over: jax.sharding.Mesh | None = None):
        if over is not None:
            device = over.devices.flat[0]
        device = device if device is not None else jax.local_devices()[0]
        super().__init__(name, memory_kind or host_memory_kind(device), device, budget, over)
