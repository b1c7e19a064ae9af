"""StateSnapshot: the training state handed to a checkpoint, with the lifetime of its arrays made explicit.

Why an object and not a dict plus flags: whether a checkpoint may copy the arrays in the background depends on
who owns them. A train engine whose arrays are immutable (jax arrays it promises not to donate) can let the
checkpoint hold them for a while; an engine whose buffers change in place (host pages) cannot. The snapshot says
which (`held`), and `release()` is the one way the checkpoint gives the arrays back. The engine that made a held
snapshot keeps it and asks `released` before it donates or overwrites anything, so no flag or Event has to be
passed through the loop and the checkpointer by hand.

    snapshot = engine.state_snapshot()           # held or not: the engine decides
    handle = checkpoint_engine.save(step, snapshot, meta)
    # not held: released before save() returns (copied in the foreground)
    # held:     released by the checkpoint's worker once its copy is done, also when the copy failed

Whoever makes a held snapshot and does not pass it to a checkpoint must release it.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Mapping

import numpy as np


class StateSnapshot:
    """The arrays of one training state (name -> numpy or jax array) and whether they stay valid until released.

    held=False: the arrays may change or vanish as soon as the caller regains control, so a checkpoint copies
    them before its save() returns. held=True: they stay alive and unchanged until `release()`, so a checkpoint
    may copy them later, off the training thread."""

    def __init__(self, arrays: Mapping[str, Any], *, held: bool = False):
        self._arrays: Mapping[str, Any] | None = arrays
        self.held = held
        self._released = threading.Event()

    @property
    def arrays(self) -> Mapping[str, Any]:
        """The arrays; an error after release (the snapshot no longer keeps them alive)."""
        arrays = self._arrays
        if arrays is None:
            raise RuntimeError("the state snapshot was released: its arrays are no longer kept")
        return arrays

    @property
    def released(self) -> bool:
        return self._released.is_set()

    def wait_released(self, timeout: float | None = None) -> bool:
        """Blocks until released (or the timeout); returns whether it is."""
        return self._released.wait(timeout)

    def release(self) -> None:
        """Gives the arrays back: drops this object's references to them and tells the engine that made it.
        Idempotent and thread-safe."""
        self._arrays = None
        self._released.set()

    def __repr__(self) -> str:
        n = "released" if self._arrays is None else f"{len(self._arrays)} arrays"
        return f"StateSnapshot({n}, held={self.held})"


def as_snapshot(state: "StateSnapshot | Mapping[str, Any]") -> StateSnapshot:
    """A plain mapping is a snapshot that is not held (its arrays may change once the caller goes on)."""
    return state if isinstance(state, StateSnapshot) else StateSnapshot(state)


class LazyArray:
    """An array read only when a checkpoint copies it (`np.asarray(lazy)`): a training state larger than RAM (pages
    on disk) goes into a snapshot one array at a time instead of all at once. `shape`, `dtype` and `nbytes` are
    known without reading."""

    def __init__(self, shape: tuple[int, ...], dtype: Any, read: Callable[[], np.ndarray]):
        self.shape, self.dtype, self._read = tuple(shape), np.dtype(dtype), read

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = np.asarray(self._read()).reshape(self.shape)
        return out if dtype is None else out.astype(dtype, copy=False)

    def __len__(self) -> int:
        return self.shape[0]

    def __int__(self) -> int:  # a scalar (a step counter) read from a lazily restored checkpoint
        return int(np.asarray(self))

    def __float__(self) -> float:
        return float(np.asarray(self))

    def __getitem__(self, index: Any) -> np.ndarray:
        return np.asarray(self)[index]

    def __repr__(self) -> str:
        return f"LazyArray({self.dtype}{list(self.shape)})"


def is_lazy(x: Any) -> bool:
    return isinstance(x, LazyArray)
