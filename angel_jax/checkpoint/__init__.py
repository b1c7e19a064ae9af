"""TRANSOM TCE for angel_jax: memory-tier snapshots, asynchronous orbax persistence, integrity, ordered restore.

    engine = CheckpointManager(CheckpointOptions(persistent_dir=Path("runs/x/checkpoints")))
    handle = engine.save(step, {"w": w, "opt/m": m}, {"data": iterator_state})   # blocks only for a memory copy
    handle = engine.save(step, StateSnapshot(arrays, held=True), meta)             # the copy in the background too
    ...                                                                            # training goes on
    errors = engine.poll_errors()                                                  # background failures, once each
    restored = engine.restore()          # newest valid: memory -> peer -> persistent, checksums verified

Modules: options (CheckpointOptions), state (StateSnapshot: the arrays handed to a save and their lifetime),
tiers (the interface every tier implements) with memtier (the memory tier; writer: its fast, buffer-reusing
snapshot writer), peer (the peer backup in a mounted directory) or netpeer (in the next node's memory, over TCP:
peer_wire the format, peer_receiver the receiving end) and persist (the orbax tier; its docstring shows how plain orbax reads a
checkpoint), or filetier (the persistent tier in the snapshot format, for checkpoints each process of a
multi-process run writes on its own); snapshot (the memory/peer directory format, reading, checking), checksum (XXH3-64 per array),
retention (pure policy), faults (the crash-test hook, passed in as a callable), worker (the background queue and
SaveHandle), engine (the manager that chains the tiers).
"""

from angel_jax.checkpoint.manager import CheckpointManager, SaveHandle
from angel_jax.checkpoint.options import CheckpointOptions
from angel_jax.checkpoint.records import (TIERS, CheckpointError, CheckpointInfo, CheckpointRef, Restored, Tier,
                                          TierState)
from angel_jax.checkpoint.state import StateSnapshot

__all__ = ["CheckpointManager", "CheckpointError", "CheckpointInfo", "CheckpointOptions", "CheckpointRef",
           "Restored", "SaveHandle", "StateSnapshot", "TIERS", "Tier", "TierState"]
