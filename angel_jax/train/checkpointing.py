"""Thin orbax checkpointing for the reference trainer: the train state plus the data iterator's state.

Kept deliberately small so `angel_jax/checkpoint/` (memory-tier snapshots, peers, integrity) can replace it.
Layout: <run_dir>/checkpoints/<step>/{state,data}; an ordinary orbax CheckpointManager directory, so plain
orbax can read it:

    mngr = ocp.CheckpointManager(path)
    restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(), data=ocp.args.JsonRestore()))
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


class ReferenceCheckpointer:
    def __init__(self, directory: Path, *, keep: int, primary: bool):
        self.directory = directory.absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        self._primary = primary

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: Any, data_state: dict) -> None:
        """Starts an asynchronous save; returns once device arrays are copied out (state may then be donated)."""
        self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                           data=ocp.args.JsonSave(data_state)))

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """(state, data iterator state) of `step`; arrays placed with the shardings of `abstract_state`."""
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        return restored.state, restored.data

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs with shardings: the restore target for `tree`'s structure."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)
