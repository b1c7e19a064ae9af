"""SerialStore: a page store whose every move is complete when the call that started it returns.

`memory.overlap: false` runs the paged engine with nothing overlapped: the baseline that measures what overlap
gains. The executor and the updater wait for each computation they dispatch; this store makes the moves wait too
(a fetch, a write-back to the disk, the freeing of a copy), so no copy or disk transfer runs beside anything else.
Everything else is the wrapped `PageStore`'s, unchanged: the same tiers, budgets and rules.

A move that fails raises here, at once, rather than from its handle later.
"""

from __future__ import annotations

from typing import Any

from angel_jax.memory.store import PageHandle, PageStore


class SerialStore:
    """`store`, with every move waited for (its own, and any it set off) before the call returns."""

    def __init__(self, store: PageStore):
        self.wrapped = store

    def __getattr__(self, name: str) -> Any:  # queries, get/read, pins, wait_all, close, tiers: the store's own
        return getattr(self.wrapped, name)

    def _settled(self, handle: PageHandle | None = None) -> PageHandle | None:
        if handle is not None:
            handle.wait()
        errors = self.wrapped.wait_all()  # (also the frees and write-backs the call set off)
        if errors:
            raise errors[0]
        return handle

    def add(self, page_id: int, value: Any, home: str = "host") -> PageHandle:
        return self._settled(self.wrapped.add(page_id, value, home))

    def remove(self, page_id: int) -> None:
        self.wrapped.remove(page_id)
        self._settled()

    def prefetch(self, page_id: int, to: str = "device", keep_source: bool = False) -> PageHandle:
        return self._settled(self.wrapped.prefetch(page_id, to, keep_source))

    def evict(self, page_id: int, frm: str = "device", to: str | None = None) -> PageHandle:
        return self._settled(self.wrapped.evict(page_id, frm, to))

    def discard(self, page_id: int, tier: str) -> PageHandle | None:
        return self._settled(self.wrapped.discard(page_id, tier))

    def writeback(self, page_id: int) -> PageHandle:
        return self._settled(self.wrapped.writeback(page_id))

    def update(self, page_id: int, new: Any, tier: str = "device") -> None:
        self.wrapped.update(page_id, new, tier)
        self._settled()

    def put(self, page_id: int, new: Any, tier: str = "host") -> None:
        self.wrapped.put(page_id, new, tier)
        self._settled()
