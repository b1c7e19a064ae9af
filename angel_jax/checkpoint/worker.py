"""The background half of a save: what a queued save carries, its progress handle, and the one worker thread.

Why one thread and a queue: saves must reach each tier in order (a newer step must never be overwritten by an
older one persisting late), and the persistent tier takes one orbax write at a time anyway. The worker is started
by the first submitted job and ends when the queue is empty, so an idle engine holds no thread. The queue is
shared with nothing but `newer_queued`, which lets a save that has not reached its slow part yet see that a newer
one is waiting (and skip its own peer copy and persistence).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from angel_jax.checkpoint.records import CheckpointError
from angel_jax.checkpoint.snapshot import SnapshotIndex
from angel_jax.checkpoint.state import StateSnapshot

_TERMINAL = ("persisted", "superseded", "failed")


class SaveHandle:
    """Progress of one save: copied -> snapshotted -> [backed_up ->] persisted | superseded | failed.

    `on_state(step, state)`, when given, is called with every state after the first, from the thread that reached
    it, before a final state wakes `wait()`."""

    def __init__(self, step: int, on_state: Callable[[int, str], None] | None = None):
        self.step = step
        self._on_state = on_state
        self.stall_s = 0.0
        self.timings: dict[str, float] = {}  # ckpt/... metric names -> seconds
        self.errors: list[CheckpointError] = []
        self._state = "copied"
        self._done = threading.Event()

    @property
    def state(self) -> str:
        return self._state

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> str:
        """Waits until the save reaches a final state and returns it (errors stay in `errors` / the engine)."""
        self._done.wait(timeout)
        return self._state

    def _advance(self, state: str) -> None:
        self._state = state
        if self._on_state is not None:
            self._on_state(self.step, state)
        if state in _TERMINAL:
            self._done.set()

    def __repr__(self) -> str:
        return f"SaveHandle(step={self.step}, state={self._state!r}, stall_s={self.stall_s:.4f})"


@dataclass
class Job:
    """One save on its way through the tiers. Only the worker thread changes it once it is queued."""

    step: int
    index: SnapshotIndex
    handle: SaveHandle
    started: float
    tmp: Path | None = None
    """The snapshot's .tmp directory; None until a held snapshot's arrays are copied."""
    held: StateSnapshot | None = None
    """A held snapshot, until the worker has copied (and released) it."""
    stage: str = "background"
    """Where the save is, for the error message when it fails: snapshot, peer, persist."""


class SaveWorker:
    """Runs `process(job)` for queued jobs, one at a time, in submission order, on its own thread."""

    def __init__(self, process: Callable[[Job], None], name: str = "ckpt-persist"):
        self._process = process
        self._name = name
        self._lock = threading.Condition()
        self._queue: deque[Job] = deque()
        self._thread: threading.Thread | None = None

    def submit(self, job: Job) -> None:
        with self._lock:
            self._queue.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=False)
                self._thread.start()
            self._lock.notify_all()

    def newer_queued(self, step: int) -> bool:
        """Whether a job of a later step waits behind the one being processed."""
        with self._lock:
            return any(j.step > step for j in list(self._queue)[1:])

    def drain(self) -> None:
        """Blocks until every submitted job is processed and the thread has ended."""
        with self._lock:
            while self._queue or self._thread is not None:
                self._lock.wait()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._thread = None
                    self._lock.notify_all()
                    return
                job = self._queue[0]  # stays queued while processed: newer_queued looks behind it
            try:
                self._process(job)
            finally:
                with self._lock:
                    self._queue.popleft()
                    self._lock.notify_all()
