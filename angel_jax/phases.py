"""The phases of a training process: one name for one thing, from the trainer's hooks through the heartbeats to
the watchdog and the anomaly detectors.

    hooks.on_phase(Phase.CHECKPOINTING, step)      # the trainer enters a phase (train/hooks.py)
    {"phase": "checkpointing", ...}                # what a heartbeat carries (a StrEnum is its value on the wire)
    phase in SLOW_PHASES                           # the watchdog: no step progress expected here
    suite.update({"step": s, "step_time": t, "phase": Phase.TRAINING})   # only training steps judge step time

A worker goes INIT -> SETUP -> RESTORING -> COMPILING -> TRAINING (<-> CHECKPOINTING, <-> EVALUATING, and RESTORING
on a rollback) -> DONE. STARTING is the watchdog's name for a worker it spawned but has not heard from yet; a worker
never sends it.
"""

from __future__ import annotations

import enum


class Phase(enum.StrEnum):
    STARTING = "starting"  # spawned, not heard from yet (the watchdog's view only)
    INIT = "init"  # the process is up (its heartbeat client runs), the trainer has not started
    SETUP = "setup"  # data, model and engine are being built
    RESTORING = "restoring"  # a checkpoint restore (at start-up, or a rollback)
    COMPILING = "compiling"  # the first step of the run or of a restart (it includes compilation)
    TRAINING = "training"  # steps
    CHECKPOINTING = "checkpointing"  # the blocking part of a save
    EVALUATING = "evaluating"  # the validation loss between two steps (the first one compiles its forward pass)
    DONE = "done"  # after the last step and the final save


TRAINER_PHASES: tuple[Phase, ...] = (Phase.SETUP, Phase.RESTORING, Phase.COMPILING, Phase.TRAINING,
                                     Phase.CHECKPOINTING, Phase.EVALUATING, Phase.DONE)
"""The phases the training loop enters (TrainHooks.on_phase)."""

WORKER_PHASES: tuple[Phase, ...] = (Phase.INIT, *TRAINER_PHASES)
"""The phases a worker's heartbeat may carry."""

SLOW_PHASES: frozenset[Phase] = frozenset(Phase) - {Phase.TRAINING}
"""Phases that make no step progress by nature: the watchdog's hang timeout is longer in them."""

BEFORE_FIRST_STEP: frozenset[Phase] = frozenset({Phase.STARTING, Phase.INIT, Phase.SETUP, Phase.RESTORING})
"""Phases a worker is in before it starts its first step (COMPILING is the first step)."""
