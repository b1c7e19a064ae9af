"""The one interface the training loop drives (`TrainEngine`), and the checks an engine makes when it loads a
checkpoint's arrays. Engines: `InMemoryEngine` (train/engines.py), `PagedTrainEngine` (train/paged.py)."""

from __future__ import annotations

from typing import Any, Mapping, Protocol, runtime_checkable

import jax
import numpy as np

from angel_jax.checkpoint.state import StateSnapshot
from angel_jax.errors import AngelError
from angel_jax.optim.guard import StepControls


class StateMismatch(AngelError, ValueError):
    """A checkpoint's arrays do not fit this engine (another model, optimizer or engine); the message names what
    differs."""


@runtime_checkable
class TrainEngine(Protocol):
    name: str
    """'in_memory' or 'paged' (recorded in every checkpoint)."""

    batch_sharding: jax.sharding.Sharding
    """Where `step` expects the global batch."""

    guards_update_norm: bool
    """Whether the engine bounds the update norm when `controls.max_update_norm` is finite; the anomaly monitor
    leaves that bound off (infinite) for an engine that does not (where guarding it would cost a second pass)."""

    checkpoints_per_process: bool
    """Whether every process checkpoints its own shards of the state (`state_snapshot` holds this process's
    shards, `state_meta` says which): a state sharded across processes, never gathered. False: the snapshot is
    the whole state, and process 0 writes it."""

    def step(self, batch: jax.Array, controls: StepControls | None = None) -> dict[str, jax.Array]:
        """One optimizer step on a global batch int32[B, T+1]; returns loss, grad_norm (before clipping),
        update_norm, lr and skipped (1.0 when the guard dropped the update) as scalars that may still be
        computing (the loop reads them one step late). `controls`: the guard's bounds and the lr multiplier
        (train/step.py); None = no bounds beyond finiteness."""

    def eval_loss(self, batch: jax.Array) -> jax.Array:
        """The mean next-token loss of a global batch int32[B, T+1] under the parameters of the last step taken
        (all of its update applied): a forward pass, no gradients, nothing of the training state, the data or the
        step count changes. A scalar that may still be computing."""

    def state_snapshot(self, may_hold: bool = True) -> StateSnapshot:
        """Every array of the training state after the last step, by stable name (numpy or jax arrays), and
        how long they stay valid. Not held: unchanged only until the next `step` call (a checkpoint copies them
        before its save returns). Held: the engine keeps them alive and unchanged (no donation, no update in
        place) until the snapshot is released, so a checkpoint may copy them in the background. The engine
        decides which it can afford (never held when `may_hold` is False: a process that writes no checkpoint
        should not wait to make one possible); whoever takes a held snapshot must release it (a save does)."""

    def state_meta(self) -> dict[str, Any]:
        """JSON: the engine name and whatever `load_state` needs to check that arrays fit (layout, shapes)."""

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
        """Replace the training state with a checkpoint's; raises StateMismatch naming what does not fit."""

    def params(self) -> Any:
        """The whole model's parameters as numpy arrays, in the structure of its family's `StagedModel.init`."""

    def memory_report(self) -> list[str]:
        """Lines for the start-up memory report: where the state lives."""

    def close(self) -> None:
        """Release threads, files and device memory."""


# --------------------------------------------------------------------------------------------- naming


def path_name(path: tuple) -> str:
    """A pytree key path as 'params/blocks/qkv/kernel' (stable across runs: the checkpoint's array names)."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def named_leaves(tree: Any) -> dict[str, Any]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    out = {path_name(p): leaf for p, leaf in leaves}
    if len(out) != len(leaves):
        raise ValueError("two leaves of the training state map to the same name")
    return out


def check_arrays(expected: Mapping[str, tuple[tuple[int, ...], np.dtype]], arrays: Mapping[str, Any],
                 what: str) -> None:
    """Raise StateMismatch naming the first missing, unexpected or differently shaped array."""
    missing = sorted(set(expected) - set(arrays))
    extra = sorted(set(arrays) - set(expected))
    if missing or extra:
        raise StateMismatch(f"{what}: the checkpoint's arrays differ from this run's state: "
                            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                            f"unexpected {extra[:5]}{'...' if len(extra) > 5 else ''} "
                            "(another model or optimizer config?)")
    for name, (shape, dtype) in expected.items():
        got = arrays[name]
        if tuple(got.shape) != tuple(shape) or np.dtype(got.dtype) != np.dtype(dtype):
            raise StateMismatch(f"{what}: array {name!r} is {np.dtype(got.dtype)}{list(got.shape)} in the "
                                f"checkpoint, {np.dtype(dtype)}{list(shape)} in this run (another model config?)")
