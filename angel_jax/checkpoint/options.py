"""Options of the checkpoint manager: where each tier lives and what retention keeps."""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from angel_jax.checkpoint.peer_wire import NetworkPeer
from angel_jax.config.fields import doc


@dataclass(frozen=True)
class CheckpointOptions:
    persistent_dir: Path = doc(Path("checkpoints"), "Root of the orbax checkpoints (one directory per step).")
    memory_dir: Path | None = doc(None, "Memory tier (tmpfs); None = /dev/shm/angel_jax-<uid>/<run id from "
                                         "persistent_dir>.")
    peer_dir: Path | None = doc(None, "Backup copy of each snapshot, e.g. a peer host's tmpfs mount; None = no peer.")
    peer_network: NetworkPeer | None = doc(None, "Backup copy of each snapshot in the next node's memory, over TCP "
                                                 "(netpeer.py); None = none. Not with peer_dir.")
    keep_last: int = doc(3, "Keep this many newest checkpoints in every tier.")
    keep_every: int | None = doc(None, "Also keep persisted steps divisible by this (persistent tier only).")
    verify_on_restore: bool = doc(True, "Check every array's XXH3-64 checksum before a restore returns it.")
    io_threads: int = doc(2, "Threads that compute checksums in parallel (1 = in the calling thread).")
    confined_to: Path | None = doc(None, "The directory the persistent tier must stay inside once symlinks are "
                                         "followed (the run directory): a checkpoint reached through a symlink out of "
                                         "it is never loaded; None = no bound beyond each tier's own root.")
    persistent_format: str = doc("orbax", "'orbax': orbax checkpoints; 'snapshot': the memory tier's directory format "
                                          "(filetier.py), fsynced and committed by rename.")

    def __post_init__(self) -> None:
        # Accept str paths (YAML, command line) but store Paths; reject impossible values naming the field.
        for key in ("persistent_dir", "memory_dir", "peer_dir", "confined_to"):
            value = getattr(self, key)
            if value is not None and not isinstance(value, Path):
                if not isinstance(value, (str, os.PathLike)):
                    raise TypeError(f"CheckpointOptions.{key}: expected a path, got {type(value).__name__}")
                object.__setattr__(self, key, Path(value))
        if not isinstance(self.keep_last, int) or self.keep_last < 1:
            raise ValueError(f"CheckpointOptions.keep_last: must be an int >= 1, got {self.keep_last!r}")
        if self.keep_every is not None and (not isinstance(self.keep_every, int) or self.keep_every < 1):
            raise ValueError(f"CheckpointOptions.keep_every: must be None or an int >= 1, got {self.keep_every!r}")
        if self.peer_dir is not None and self.peer_network is not None:
            raise ValueError("CheckpointOptions: peer_dir and peer_network are two peer tiers; give one")
        if self.persistent_format not in ("orbax", "snapshot"):
            raise ValueError(f"CheckpointOptions.persistent_format: 'orbax' or 'snapshot', got "
                             f"{self.persistent_format!r}")
        if not isinstance(self.io_threads, int) or self.io_threads < 1:
            raise ValueError(f"CheckpointOptions.io_threads: must be an int >= 1, got {self.io_threads!r}")

    def resolved_memory_dir(self) -> Path:
        """The memory tier's directory. The default depends only on persistent_dir, so a restarted process finds the
        snapshots its predecessor left in /dev/shm. Pure: creates nothing."""
        if self.memory_dir is not None:
            return self.memory_dir
        absolute = os.path.abspath(self.persistent_dir)
        run_id = f"{Path(absolute).name}-{hashlib.sha1(absolute.encode()).hexdigest()[:10]}"
        base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
        # Per user: another user's directory of the same name could neither be used nor be trusted.
        return base / f"angel_jax-{os.getuid()}" / run_id
