"""Trace: the ordered stage accesses of one training step, the sequence the planner plans and the executor runs.

Angel-PTM records this during the first iteration; here the stage structure makes it known ahead of time, so the
trace is computed from the number of stages instead of being recorded:

    forward   stage 0 .. N-2            (the head's forward is fused into its backward)
    head      stage N-1: loss and gradients
    backward  stage N-2 .. 0            (recompute from the saved stage input, then vjp)
    update    stage 0 .. N-1            (after the global gradient norm is known; forward order, so step t+1's
                                         first stages are ready first)

A stage's parameter pages are read by its forward and backward (for the head: its one access); its updates
rewrite its parameter and optimizer pages (angel_jax/optim/updater.py runs them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Op = Literal["forward", "head", "backward", "update"]


@dataclass(frozen=True)
class Access:
    op: Op
    stage: int
    """Index into the model's stages."""


def trace_step(n: int) -> tuple[Access, ...]:
    """Every access of one step of an n-stage model, in order."""
    seq = [Access("forward", i) for i in range(n - 1)]
    seq.append(Access("head", n - 1))
    seq += [Access("backward", i) for i in range(n - 2, -1, -1)]
    seq += [Access("update", i) for i in range(n)]
    return tuple(seq)


def compute_sequence(n: int) -> list[tuple[str, int]]:
    """(op, stage) of the compute accesses of one step (the updates excluded), in order."""
    return [(a.op, a.stage) for a in trace_step(n) if a.op != "update"]
