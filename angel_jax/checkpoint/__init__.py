"""TRANSOM TCE for angel_jax: memory-tier snapshots, asynchronous orbax persistence, integrity, ordered restore.

    engine = CheckpointEngine(CheckpointOptions(persistent_dir=Path("runs/x/checkpoints")))
    handle = engine.save(step, {"w": w, "opt/m": m}, {"data": iterator_state})   # blocks only for a memory copy
    ...                                                                            # training goes on
    errors = engine.poll_errors()                                                  # background failures, once each
    restored = engine.restore()          # newest valid: memory -> peer -> persistent, checksums verified

Modules: options (CheckpointOptions), snapshot (the memory/peer directory format, reading, checking), memtier
(the fast, buffer-reusing snapshot writer), checksum (XXH3-64 per array), persist (the orbax tier; its docstring
shows how plain orbax reads a checkpoint), retention (pure policy), faults (crash-test hook), engine (the shell).
"""

from angel_jax.checkpoint.engine import CheckpointEngine, SaveHandle
from angel_jax.checkpoint.options import CheckpointOptions
from angel_jax.checkpoint.records import (TIERS, CheckpointError, CheckpointInfo, CheckpointRef, Restored, Tier,
                                          TierState)

__all__ = ["CheckpointEngine", "CheckpointError", "CheckpointInfo", "CheckpointOptions", "CheckpointRef",
           "Restored", "SaveHandle", "TIERS", "Tier", "TierState"]
