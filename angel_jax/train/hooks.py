"""Hooks: how the outside world watches a training run without the loop knowing who is watching.

The loop calls, in order, on process 0 and every other process alike:

    on_phase("setup", 0)                    before data, model and engine are built
    on_phase("restoring", k)                before a checkpoint restore (k = 0 when nothing to restore)
    on_phase("compiling", start)            before the first step (it includes compilation)
    on_batch(step, index, rows) -> rows     each batch before it is used (index: global batch index); may
                                            replace it (fault injection, data filters)
    on_controls(step, controls) -> controls each step's guard bounds and lr multiplier; may replace them
    on_phase("training", step)              once the first step is done
    on_phase("evaluating", step) ...        around an evaluation (every train.eval_every steps) ...
    on_phase("training", step)              ... and after it
    on_step(step, values)                   after each step's metrics are read (values: loss, grad_norm, perf/...,
                                            eval/... at evaluated steps)
    on_phase("checkpointing", step)         around the blocking part of a save ...
    on_phase("training", step)              ... and after it
    on_checkpoint(step, info)               when a save's blocking part is done (info: stall_s, state)
    on_anomaly(event)                       an anomaly was detected (event: detector, step, action, message, ...)
    on_phase("restoring", k) ...            a rollback to the checkpoint of step k, then "training" again
    on_phase("done", last_step)             after the last step and the final save

A hook may raise to stop the run (the loop still waits for in-flight checkpoint work before the exception
propagates). The watchdog's heartbeat client and the fault injectors of the tests are hooks; so is `OnStep`, the
plain callback that tests use to collect exact per-step values.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from angel_jax.phases import TRAINER_PHASES, Phase  # noqa: F401 - TRAINER_PHASES: what on_phase is called with


class TrainHooks:
    """Base class: every method does nothing. Subclass and override what you need."""

    def on_phase(self, phase: Phase, step: int) -> None:
        """The run enters `phase` (one of TRAINER_PHASES) at `step` (the last completed step)."""

    def on_batch(self, step: int, index: int, rows: Any) -> Any:
        """This process's rows of the batch of `step` (global batch `index`); return them, or a replacement."""
        return rows

    def on_controls(self, step: int, controls: Any) -> Any:
        """The StepControls of `step`; return them, or a replacement."""
        return controls

    def on_step(self, step: int, values: dict[str, float]) -> None:
        """Step `step` is done; `values` are its metrics as Python floats."""

    def on_checkpoint(self, step: int, info: dict[str, Any]) -> None:
        """The blocking part of the save of `step` is done."""

    def on_anomaly(self, event: dict[str, Any]) -> None:
        """An anomaly was found; `event` is what events.jsonl records (detector, step, action, message, ...).
        A watchdog client forwards restart / exclude requests to the coordinator from here."""

    def close(self) -> None:
        """The run is over (normally or not)."""


class OnStep(TrainHooks):
    """A hook from a plain `fn(step, values)` callback."""

    def __init__(self, fn: Callable[[int, dict[str, float]], None]):
        self.fn = fn

    def on_step(self, step: int, values: dict[str, float]) -> None:
        self.fn(step, values)


class HookList(TrainHooks):
    """Calls each hook in order."""

    def __init__(self, hooks: Iterable[TrainHooks]):
        self.hooks = list(hooks)

    def on_phase(self, phase: Phase, step: int) -> None:
        for h in self.hooks:
            h.on_phase(phase, step)

    def on_batch(self, step: int, index: int, rows: Any) -> Any:
        for h in self.hooks:
            rows = h.on_batch(step, index, rows)
        return rows

    def on_controls(self, step: int, controls: Any) -> Any:
        for h in self.hooks:
            controls = h.on_controls(step, controls)
        return controls

    def on_step(self, step: int, values: dict[str, float]) -> None:
        for h in self.hooks:
            h.on_step(step, values)

    def on_checkpoint(self, step: int, info: dict[str, Any]) -> None:
        for h in self.hooks:
            h.on_checkpoint(step, info)

    def on_anomaly(self, event: dict[str, Any]) -> None:
        for h in self.hooks:
            h.on_anomaly(event)

    def close(self) -> None:
        for h in self.hooks:
            h.close()
