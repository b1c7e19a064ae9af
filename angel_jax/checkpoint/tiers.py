"""The one interface of a checkpoint tier, and the retention every tier applies to itself.

Three tiers hold checkpoints, fastest first: memory (snapshots in tmpfs, memtier.py), peer (a copy of each
snapshot on another host's mount, peer.py) and persistent (ordinary orbax checkpoints, persist.py; or snapshot
directories on disk, filetier.py). Restore, listing, verification and retention treat them alike, so they share
this interface and the manager (engine.py) loops over tiers instead of naming each. What differs is how a step gets in:

    memory tier        written from the training state (MemoryTier.prepare / copy / commit): the only blocking part
    peer, persistent   `copy_from(source)`: a committed memory-tier snapshot copied in the background (CopyTier)

A tier never decides which step is the newest valid one or in what order tiers are tried: that is the manager's.
Steps are identified by number; `scan` maps them to their directories (committed, and partial = unfinished
writes that are never read).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from angel_jax.checkpoint.records import Tier
from angel_jax.checkpoint.retention import steps_to_keep
from angel_jax.checkpoint import snapshot as snap
from angel_jax.checkpoint.snapshot import SnapshotIndex, dir_bytes, remove_dir


@dataclass(frozen=True)
class Committed:
    """A committed memory-tier snapshot, the source every downstream tier copies from."""

    step: int
    path: Path
    index: SnapshotIndex
    """With checksums: what the snapshot's index.json holds."""


class CheckpointTier(ABC):
    """Where checkpoints of one kind live: list, load, check and delete steps; keep what retention says.

    `keep_last` newest committed steps are kept; `keep_every` (when given) also keeps every step divisible by it
    (the persistent tier's long-term history; the memory and peer tiers are bounded by RAM and get None).
    Constructors have no side effects: directories are created by the first write."""

    name: ClassVar[Tier]
    """'memory', 'peer' or 'persistent' (Restored.source, CheckpointRef.tier, list()'s keys)."""
    committed_state: ClassVar[str]
    """What list() calls a committed copy here: 'snapshotted', 'backed_up' or 'persisted'."""

    def __init__(self, root: Path, keep_last: int, keep_every: int | None = None):
        self.root = root
        self.keep_last = keep_last
        self.keep_every = keep_every

    @abstractmethod
    def scan(self) -> tuple[dict[int, Path], dict[int, Path]]:
        """(committed, partial) step directories; a missing root is an empty tier."""

    @abstractmethod
    def load(self, step: int, *, verify: bool, pool: Executor | None,
             select: snap.Select | None = None) -> tuple[SnapshotIndex, dict[str, np.ndarray]]:
        """A committed step's index and arrays (those `select` keeps: only they are read and verified); raises
        snapshot.SnapshotDamaged naming every problem."""

    @abstractmethod
    def check(self, step: int, pool: Executor | None) -> list[str]:
        """Every problem of a committed step (structure and checksums); empty = usable. Reads every byte."""

    @abstractmethod
    def delete(self, step: int) -> None:
        """Removes a committed step (nothing happens when it is not there)."""

    def remove_partial(self) -> None:
        """Deletes unfinished writes (a crashed predecessor's): they hold space and are never read."""
        for path in self.scan()[1].values():
            remove_dir(path)

    def retain(self, protect: frozenset[int] | set[int] = frozenset()) -> None:
        """Deletes the committed steps retention does not keep, except those in `protect`."""
        committed, _ = self.scan()
        keep = steps_to_keep(committed, self.keep_last, self.keep_every)
        for step in committed:
            if step not in keep and step not in protect:
                self.delete(step)

    def sizes(self) -> tuple[dict[int, tuple[Path, int]], dict[int, tuple[Path, int]]]:
        """scan() with the bytes of each directory: (committed, partial) as step -> (path, bytes)."""
        committed, partial = self.scan()
        return ({s: (p, dir_bytes(p)) for s, p in committed.items()},
                {s: (p, dir_bytes(p)) for s, p in partial.items()})

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.root})"


class CopyTier(CheckpointTier):
    """A tier filled in the background from committed memory-tier snapshots (peer, persistent)."""

    stage: ClassVar[str]
    """The stage its errors and timings are named by: CheckpointError.stage, `ckpt/<stage>_s`."""
    best_effort: ClassVar[bool]
    """True: a failed copy is reported and the save goes on to the next tier (the peer backup). False: the
    save fails (the persistent tier: without it the save is not done)."""

    @abstractmethod
    def copy_from(self, source: Committed) -> Path:
        """Copies a committed snapshot into this tier and commits it atomically; returns the committed path.
        On failure nothing partial is left behind and the error is raised."""


class SnapshotDirectories:
    """Reading a tier kept in the snapshot format (snapshot.py: `step_<k>/` directories under `root`), as the
    memory and peer tiers are."""

    root: Path

    def scan(self) -> tuple[dict[int, Path], dict[int, Path]]:
        return snap.scan(self.root)

    def _path(self, step: int) -> Path:
        return self.scan()[0].get(step, snap.step_dir(self.root, step))

    def check(self, step: int, pool: Executor | None) -> list[str]:
        # Read-only shared mappings, dropped on return: checking never pins a snapshot the way restore's views do.
        return snap.check(self._path(step), pool)
