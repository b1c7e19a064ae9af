"""Trace: the ordered page accesses of one training step, the sequence the planner plans against.

Angel-PTM records this during the first iteration; here the stage structure makes it known ahead of time, so the
trace is computed from the stages and their page ids instead of being recorded:

    forward   stage 0 .. N-2            (the head's forward is fused into its backward)
    head      stage N-1: loss and gradients
    backward  stage N-2 .. 0            (recompute from the saved stage input, then vjp)
    update    stage 0 .. N-1            (after the global gradient norm is known; forward order, so step t+1's
                                         first stages are ready first)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from angel_jax.memory.layout import PageLayout
from angel_jax.stages import StagedModel

Op = Literal["forward", "head", "backward", "update"]


@dataclass(frozen=True)
class Access:
    op: Op
    stage: int
    """Index into the model's stages."""
    pages: tuple[int, ...]
    """Parameter page ids the access reads on the device (updates: the pages they rewrite)."""


def trace_step(staged: StagedModel, layout: PageLayout) -> tuple[Access, ...]:
    n = len(staged.stages)
    pages = [layout.stage(s.name).page_ids for s in staged.stages]
    seq = [Access("forward", i, pages[i]) for i in range(n - 1)]
    seq.append(Access("head", n - 1, pages[n - 1]))
    seq += [Access("backward", i, pages[i]) for i in range(n - 2, -1, -1)]
    seq += [Access("update", i, pages[i]) for i in range(n)]
    return tuple(seq)


def next_use(trace: tuple[Access, ...], position: int, stage: int, *, cyclic: bool = True) -> float:
    """Distance from `position` to the next compute access of `stage` (the next step's accesses follow when
    cyclic); inf if never. Used for farthest-next-use eviction."""
    compute = [k for k, a in enumerate(trace) if a.op != "update"]
    for k in compute:
        if k > position and trace[k].stage == stage:
            return k - position
    if cyclic:
        for k in compute:
            if trace[k].stage == stage:
                return len(trace) - position + k
    return float("inf")
