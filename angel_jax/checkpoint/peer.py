"""The peer tier: a copy of each memory-tier snapshot in another directory, typically a peer host's mount (or,
over the network, in the next node's memory: netpeer.py; `peer_tier` picks the one the options ask for).

TRANSOM's backup: when this host dies with its tmpfs, the neighbour still has the newest snapshot, and restoring
from it is as fast as from the memory tier (the same directory format, snapshot.py). The copy is best effort: a
full or failing peer is reported and the save goes on to the persistent tier.

Files are fsynced before the commit rename because a peer directory is usually a network or disk mount, unlike
/dev/shm. A failed copy removes its `.tmp` directory: it would hold the space the peer lacked.
"""

from __future__ import annotations

from concurrent.futures import Executor
from pathlib import Path

import numpy as np

from angel_jax.checkpoint import snapshot as snap
from angel_jax.checkpoint.faults import Fault, no_fault
from angel_jax.checkpoint.netpeer import NetworkPeerTier
from angel_jax.checkpoint.options import CheckpointOptions
from angel_jax.checkpoint.tiers import Committed, CopyTier, SnapshotDirectories


def peer_tier(options: CheckpointOptions, fault: Fault = no_fault) -> CopyTier | None:
    """The peer tier the options ask for: a mounted directory (PeerTier), the next node's memory over the
    network (netpeer.NetworkPeerTier), or none."""
    if options.peer_network is not None:
        return NetworkPeerTier(options.peer_network, options.keep_last, fault=fault)
    if options.peer_dir is not None:
        return PeerTier(options.peer_dir, options.keep_last, fault=fault)
    return None


class PeerTier(SnapshotDirectories, CopyTier):
    """Snapshot directories `step_<k>/` under `root`, copied from the memory tier."""

    name = "peer"
    committed_state = "backed_up"
    stage = "peer"
    best_effort = True

    def __init__(self, root: Path, keep_last: int, *, fault: Fault = no_fault):
        super().__init__(root, keep_last)
        self._fault = fault

    def load(self, step: int, *, verify: bool, pool: Executor | None,
             select: snap.Select | None = None) -> tuple[snap.SnapshotIndex, dict[str, np.ndarray]]:
        return snap.load(self._path(step), verify=verify, pool=pool, select=select)

    def delete(self, step: int) -> None:
        for path in (p for s, p in self.scan()[0].items() if s == step):
            snap.remove_dir(path)

    def copy_from(self, source: Committed) -> Path:
        step = source.step
        return snap.copy_committed(source.path, self.root, step, fault=lambda: self._fault("peer.commit", step))
