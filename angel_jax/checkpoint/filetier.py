"""The persistent tier in the snapshot format: `step_<k>/` directories (data.bin + index.json, snapshot.py) on disk,
fsynced and committed by rename, as the peer tier keeps them, in place of orbax checkpoints.

Selected by `CheckpointOptions.persistent_format="snapshot"`: no orbax on the way, the layout the memory and
peer tiers use. Before orbax could write a process's own shards (orbax_local.py), the processes of a multi-process
run persisted their shards in this format; such runs still resume from it (`persistent_format_of` in
angel_jax/train/checkpointing.py). Everything that reads checkpoints (restore, verify, `angel-jax ckpt`) treats it
as the persistent tier.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np

from angel_jax.checkpoint import snapshot as snap
from angel_jax.checkpoint.faults import Fault, no_fault
from angel_jax.checkpoint.peer import PeerTier
from angel_jax.checkpoint.tiers import Committed
from angel_jax.checkpoint.writer import MemoryTierFull, SnapshotWriter


class FileTier(PeerTier):
    """Snapshot directories `step_<k>/` under `root`: the persistent tier (retention keeps `keep_every` too)."""

    name = "persistent"
    committed_state = "persisted"
    stage = "persist"
    best_effort = False

    def __init__(self, root: Path, keep_last: int, keep_every: int | None = None, *, fault: Fault = no_fault):
        super().__init__(root, keep_last, fault=fault)
        self.keep_every = keep_every
        self._fault = fault

    def copy_from(self, source: Committed) -> Path:
        step = source.step
        return snap.copy_committed(source.path, self.root, step, fault=lambda: self._fault("persist.commit", step))

    def save(self, index: snap.SnapshotIndex, arrays: Mapping[str, np.ndarray]) -> Path:
        """Persists `arrays` directly (the memory tier could not take them), `index` already holding their
        checksums: written under `step_<k>.tmp/`, fsynced, renamed. Nothing partial is left on failure."""
        step = index.step
        writer = SnapshotWriter(self.root)
        tmp = snap.tmp_dir(self.root, step)
        try:
            try:
                tmp = writer.prepare(step, index, [])
            except MemoryTierFull as e:  # the writer's name for "no room": here, the persistent directory's disk
                raise OSError(e.errno, f"persistent tier {self.root}: cannot reserve {index.data_bytes} bytes") from e
            writer.copy(tmp, index, arrays)
        except BaseException:
            writer.close()
            snap.remove_dir(tmp)
            raise
        writer.close()
        snap.write_index(tmp, index)
        snap.fsync_files(tmp)
        self._fault("persist.commit", step)
        final = snap.step_dir(self.root, step)
        snap.replace_dir(tmp, final)
        return final
