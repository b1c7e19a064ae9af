"""The future plumbing of page moves: `PageHandle` (what a move returns), reused staging buffers for disk reads,
and small helpers for `concurrent.futures`."""

from __future__ import annotations

import concurrent.futures as cf
import threading
from typing import Any, Callable

import jax
import numpy as np

from angel_jax.memory import direct_io


def resolved(value: Any = None) -> cf.Future:
    f: cf.Future = cf.Future()
    f.set_result(value)
    return f


class PageHandle:
    """A move in flight. `wait()` blocks until the data is in place and the source freed, and re-raises the
    move's error (BudgetExceeded is raised at issue instead, never here)."""

    __slots__ = ("page_id", "op", "_future")

    def __init__(self, page_id: int, op: str, future: cf.Future):
        self.page_id, self.op, self._future = page_id, op, future

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> "PageHandle":
        value = self._future.result(timeout)
        if isinstance(value, jax.Array):
            try:
                value.block_until_ready()
            except RuntimeError:
                if not value.is_deleted():  # deleted: a later move already took the copy away
                    raise
        return self

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    def __repr__(self) -> str:
        return f"PageHandle(page={self.page_id}, op={self.op!r}, done={self.done()})"


class StagingBuffers:
    """Reused host buffers that disk reads land in before `device_put` copies them into a tier: a fresh 64 MiB
    buffer per read costs more in page faults than the copy itself. Keeps at most `keep` idle buffers per
    (dtype, length); `idle_bytes` is what they hold."""

    def __init__(self, keep: int):
        self.keep = keep
        self._free: dict[tuple[str, int], list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def take(self, dtype: np.dtype, length: int) -> np.ndarray:
        with self._lock:
            free = self._free.get((dtype.name, length))
            if free:
                return free.pop()
        return direct_io.aligned_empty(length, dtype)  # the disk tier's O_DIRECT reads land in it without a bounce

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            free = self._free.setdefault((buf.dtype.name, buf.shape[0]), [])
            if len(free) < self.keep:
                free.append(buf)

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for free in self._free.values() for b in free)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


def when_done(future: cf.Future, fn: Callable[[cf.Future], Any]) -> None:
    """`future.add_done_callback(fn)`, with `fn` let go once it ran. A completed `concurrent.futures.Future` keeps
    every callback it was given, so a callback whose closure reaches back to the future (a page copy's record
    holds its future; the callback holds the record) would make a reference cycle, and the page arrays in it
    would stay in memory until Python's cyclic collector happened to run: gigabytes, with large pages."""
    future.add_done_callback(_Once(fn))


class _Once:
    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[cf.Future], Any]):
        self.fn: Callable[[cf.Future], Any] | None = fn

    def __call__(self, future: cf.Future) -> None:
        fn, self.fn = self.fn, None
        if fn is not None:
            fn(future)


def copy_result(src: cf.Future, dst: cf.Future) -> None:
    """Complete `dst` like `src` (unless already done)."""
    if dst.done():
        return
    if src.exception() is not None:
        dst.set_exception(src.exception())
    else:
        dst.set_result(src.result())
