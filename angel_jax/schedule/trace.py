"""Trace: the ordered stage accesses of one training step, the sequence the planner plans and the executor runs.

Angel-PTM records this during the first iteration; here the stage structure makes it known ahead of time, so the
trace is computed from the number of stages instead of being recorded:

    forward   stage 0 .. N-2            (the head's forward is fused into its backward)
    head      stage N-1: loss and gradients
    backward  stage N-2 .. 0            (recompute from the saved stage input, then vjp)
    update    stage 0 .. N-1            (after the global gradient norm is known; forward order, so step t+1's
                                         first stages are ready first)

A stage's parameter pages are read by its forward and backward (for the head: its one access); its updates
rewrite its parameter and optimizer pages (angel_jax/schedule/updater.py runs them).

With several micro-batches per step (`train.micro_batch_size`) the order is layer-major: each access runs its
stage on every micro-batch before the next access, so the accesses, and the parameter pages fetched for them, are
those of one micro-batch. `split_batch` is the one split into micro-batches both engines use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import jax

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


def split_batch(batch: jax.Array, micro_batches: int) -> jax.Array:
    """int32[B, T+1] -> [micro_batches, B / micro_batches, T+1]: micro-batch m is rows m, m + M, m + 2M, ... A
    batch sharded by contiguous rows over data-parallel ranks (B = M x micro x ranks) keeps every micro-batch's rows
    of a rank on that rank: each micro-batch is split over the ranks as the whole batch is."""
    b = batch.shape[0]
    if micro_batches < 1 or b % micro_batches:
        raise ValueError(f"a batch of {b} rows does not split into {micro_batches} micro-batches")
    return batch.reshape(b // micro_batches, micro_batches, *batch.shape[1:]).swapaxes(0, 1)
