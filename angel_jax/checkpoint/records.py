"""The engine's public result types and its error."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from angel_jax.errors import AngelError

Tier = Literal["memory", "peer", "persistent"]
TIERS: tuple[Tier, ...] = ("memory", "peer", "persistent")  # restore order: fastest first


class CheckpointError(AngelError):
    """A checkpoint could not be saved or restored; `step` and `stage` say which and where (None when unknown)."""

    def __init__(self, message: str, *, step: int | None = None, stage: str | None = None,
                 errors: list["CheckpointError"] | None = None):
        super().__init__(message)
        self.step = step
        self.stage = stage
        self.errors = errors or []


@dataclass(frozen=True)
class CheckpointRef:
    """A verified checkpoint: the step, the tier it would be restored from, and its directory."""

    step: int
    tier: Tier
    path: Path


@dataclass(frozen=True)
class TierState:
    """One step in one tier: 'snapshotted' (memory), 'backed_up' (peer), 'persisted', or 'partial' (uncommitted)."""

    state: str
    nbytes: int
    path: Path


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    tiers: dict[str, TierState] = field(default_factory=dict)

    @property
    def committed(self) -> bool:
        return any(t.state != "partial" for t in self.tiers.values())


@dataclass
class Restored:
    """A restored checkpoint. Arrays from the memory or peer tier are copy-on-write views of the snapshot file:
    writable, and writing to them never changes the snapshot."""

    step: int
    arrays: dict[str, np.ndarray]
    """By name; a partial restore (`restore(select=...)`) holds only the arrays it selected."""
    meta: dict[str, Any]
    source: Tier
    path: Path
