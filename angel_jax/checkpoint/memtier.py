"""The memory tier: snapshots in a tmpfs directory that outlives the process (`/dev/shm` by default).

A save's only blocking part is the copy into this tier, so it is written in three steps that the manager can
place on different threads:

    prepare + copy  (write)   step_<k>.tmp/data.bin reserved and filled from the arrays      (training thread, or
                                                                                              the worker for held
                                                                                              snapshots)
    commit                    XXH3-64 of the copy, index.json, rename to step_<k>/          (the worker)

Pins: while background work still needs a step's snapshot (to checksum it, copy it to the peer, persist it), the
step is pinned and neither retention nor the recycling of evicted snapshots (writer.py) touches it. Pinning a step
that is already pinned waits, so the same step saved again waits for its previous save. One lock guards the pins
and every rename and delete in the tier; copies and checksums run outside it.
"""

from __future__ import annotations

import errno
import os
import threading
from concurrent.futures import Executor
from pathlib import Path
from typing import Mapping

import numpy as np
import psutil

from angel_jax.checkpoint import snapshot as snap
from angel_jax.checkpoint.faults import Fault, no_fault
from angel_jax.checkpoint.retention import steps_to_keep
from angel_jax.checkpoint.tiers import CheckpointTier, Committed, SnapshotDirectories
from angel_jax.checkpoint.writer import MemoryTierFull, SnapshotWriter

__all__ = ["MemoryTier", "MemoryTierFull", "in_ram"]

RAM_MARGIN = 2 << 30
"""RAM a snapshot written into a RAM-backed memory tier must leave available to the machine."""
RAM_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})


def in_ram(path: Path) -> bool:
    """Whether `path` lives on a file system whose files are RAM (tmpfs, ramfs: /dev/shm by default), by the
    longest mount point that contains it."""
    target = os.path.realpath(path)
    best, fstype = "", ""
    for part in psutil.disk_partitions(all=True):
        mount = part.mountpoint.rstrip("/") or "/"
        if (target == mount or target.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
            best, fstype = mount, part.fstype
    return fstype in RAM_FILESYSTEMS


class MemoryTier(SnapshotDirectories, CheckpointTier):
    """Snapshot directories `step_<k>/` under `root`, written by recycling evicted snapshots' files."""

    name = "memory"
    committed_state = "snapshotted"

    def __init__(self, root: Path, keep_last: int, *, fault: Fault = no_fault):
        super().__init__(root, keep_last)
        self._fault = fault
        self._lock = threading.Condition()  # the pins, and every rename/delete under root
        self._pinned: set[int] = set()
        self._writer: SnapshotWriter | None = None  # created by the first write or load: constructors do nothing

    def _snapshot_writer(self) -> SnapshotWriter:
        if self._writer is None:
            self._writer = SnapshotWriter(self.root)
        return self._writer

    # ------------------------------------------------------------------------------------------- pins

    def pin(self, step: int) -> None:
        """Protects `step`'s snapshot until `unpin`; waits while another save of the same step holds it."""
        with self._lock:
            while step in self._pinned:
                self._lock.wait()
            self._pinned.add(step)

    def unpin(self, step: int) -> None:
        with self._lock:
            self._pinned.discard(step)
            self._lock.notify_all()

    # ------------------------------------------------------------------------------------------- reading

    def load(self, step: int, *, verify: bool, pool: Executor | None,
             select: snap.Select | None = None) -> tuple[snap.SnapshotIndex, dict[str, np.ndarray]]:
        path = self._path(step)
        index, arrays = snap.load(path, verify=verify, pool=pool, select=select)
        self._snapshot_writer().mark_exported(path)  # its bytes back these arrays: never overwrite in place
        return index, arrays

    # ------------------------------------------------------------------------------------------- deleting

    def delete(self, step: int) -> None:
        with self._lock:
            for path in (p for s, p in self.scan()[0].items() if s == step):
                snap.remove_dir(path)

    def retain(self, protect: frozenset[int] | set[int] = frozenset()) -> None:
        """keep_last newest snapshots; pinned steps are never removed."""
        with self._lock:
            super().retain(self._pinned | set(protect))

    def remove_partial(self) -> None:
        """`.tmp` directories of steps nobody is writing (a recycling save may have taken its pick already)."""
        with self._lock:
            for step, path in self.scan()[1].items():
                if step not in self._pinned:
                    snap.remove_dir(path)

    # ------------------------------------------------------------------------------------------- writing

    def write(self, step: int, index: snap.SnapshotIndex, host: Mapping[str, np.ndarray]) -> Path:
        """Copies `host` into `step_<k>.tmp/` (not yet committed) and returns that directory. The step must be
        pinned. Raises MemoryTierFull when the tier cannot take it (full, or not creatable)."""
        writer = self._snapshot_writer()
        with self._lock:
            committed, partial = self.scan()
            keep = steps_to_keep([*committed, step], self.keep_last)
            victims = [p for s, p in sorted(committed.items()) if s not in keep and s not in self._pinned]
            victims += [p for s, p in partial.items() if s not in self._pinned or s == step]
            self._check_ram(index.data_bytes - sum(snap.dir_bytes(p) for p in victims))
            try:
                tmp = writer.prepare(step, index, victims)
            except MemoryTierFull:
                raise
            except OSError as e:  # e.g. memory_dir not creatable: same fallback as a full tier
                raise MemoryTierFull(e.errno, f"memory tier {self.root}: {e}") from e
        writer.copy(tmp, index, host, after_first=lambda: self._fault("snapshot.copy", step))
        return tmp

    def _check_ram(self, new_bytes: int) -> None:
        """A tmpfs holds its files in RAM: a snapshot that would leave the machine with less than `RAM_MARGIN`
        available (after reusing the evicted snapshots' files) is refused as if the tier were full, so a state
        near the size of RAM is persisted directly instead of meeting the OOM killer."""
        if new_bytes <= 0 or not in_ram(self.root):
            return
        available = int(psutil.virtual_memory().available)
        if available - new_bytes < RAM_MARGIN:
            raise MemoryTierFull(errno.ENOMEM, f"memory tier {self.root}: the snapshot would take {new_bytes:,} B "
                                               f"more of RAM, {available:,} B are available (keeping "
                                               f"{RAM_MARGIN:,} B free)")

    def commit(self, step: int, tmp: Path, index: snap.SnapshotIndex, pool: Executor | None) -> Committed:
        """Checksums the copy in `tmp`, writes its index and renames it to `step_<k>/`: from now on it is a
        checkpoint. Why here and not in write: hashing is cheap but not free, and it reads the copy, never the
        live arrays, so it can run in the background."""
        _, views = snap.map_data(tmp, index, private=False)
        index = snap.checksummed(index, views, pool)
        del views
        snap.write_index(tmp, index)
        self._fault("snapshot.commit", step)
        with self._lock:
            final = snap.step_dir(self.root, step)
            snap.replace_dir(tmp, final)
        return Committed(step, final, index)

    def close(self) -> None:
        """Unmaps the writer's cached files."""
        if self._writer is not None:
            self._writer.close()
