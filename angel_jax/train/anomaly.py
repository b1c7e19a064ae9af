"""The trainer's side of anomaly detection (TEE): detectors on every step, actions the loop can take.

    monitor = AnomalyMonitor(cfg.anomaly, rank=0, primary=True, events=EventLog(...))
    controls = monitor.controls()             # the guard's bounds for the next step (dropped on the device)
    verdict = monitor.observe(step, values)   # after the step's figures are read
    verdict.action                            # None, or ROLLBACK / RESTART / EXCLUDE for the loop to carry out

How each action happens:
- log       the event is written to events.jsonl and the metrics (anomaly/<detector> = 1), nothing else.
- skip      on the device, by the step itself: `controls()` turns the state of every spike detector whose action
            is skip or stronger into a bound (`SpikeDetector.bound`), and the step drops an update whose loss,
            gradient norm or update norm is above its bound or non-finite. The host reads figures a step late, so
            a skip decided on the host would come after the update; the bound comes from the detector state one
            step earlier, so it can lag by a step; and the paged engine does not bound the update norm (a second
            pass over every stage). The event then says the update was applied.
- rollback  the loop restores the newest valid checkpoint and moves the data past the offending window
            (every batch since the checkpoint, up to and including the bad one), recording the window.
- restart,  the loop stops the process with RestartRequested (exit status 75, 76 for exclude) after the event
  exclude   is reported to the hooks; the watchdog restarts the group from the last checkpoint (without the
            node, for exclude). A run without a watchdog says so and stops; running it again resumes.

Escalation, so that a persistent problem ends instead of looping: `max_consecutive_skips` dropped updates in a
row, or `max_rollbacks` rollbacks without a new checkpoint in between, stop the run with TrainingDiverged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import jax
import psutil

from angel_jax.config import AnomalyDetectionConfig
from angel_jax.errors import AngelError
from angel_jax.optim.guard import StepControls
from angel_jax.phases import Phase
from angel_jax.tee.actions import Action, ActionPolicy, DetectorSuite
from angel_jax.tee.detectors import Anomaly
from angel_jax.tee.events import EventLog
from angel_jax.units import device_bytes_in_use

log = logging.getLogger(__name__)


# Detectors whose figures are the same on every process (computed from the global batch): only they may change
# the step loop (skip, rollback), which every process must do alike. The others judge local time and memory.
_REPLICATED = ("nan", "loss_spike", "grad_spike", "update_spike")
_GUARDS = {"loss_spike": "max_loss", "grad_spike": "max_grad_norm", "update_spike": "max_update_norm"}


class TrainingDiverged(AngelError, RuntimeError):
    """Training cannot go on: NaN/Inf or spikes that skips and rollbacks did not cure; the message names the step."""


class RestartRequested(AngelError, RuntimeError):
    """An anomaly asked for a restart (or for excluding this node); `exit_code` is what the process returns."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class Verdict:
    """What the loop must do about a step."""

    action: Action | None = None
    """ROLLBACK, RESTART or EXCLUDE when the loop has to act; None otherwise (logged or skipped already)."""
    events: list[dict[str, Any]] = field(default_factory=list)
    """The anomaly events of this step, as written to events.jsonl."""
    metrics: dict[str, float] = field(default_factory=dict)
    """anomaly/<detector> = 1.0 for each detector that fired."""

    @property
    def reason(self) -> str:
        return "; ".join(e["message"] for e in self.events if e.get("requested") == self.action) or "anomaly"


class AnomalyMonitor:
    """In-process detectors with their policy, the guard's bounds, the event log and the escalation counters."""

    def __init__(self, cfg: AnomalyDetectionConfig, *, rank: int, primary: bool, events: EventLog | None):
        self.cfg = cfg
        self.enabled = cfg.enabled
        self.policy = ActionPolicy.from_dict(cfg.actions)
        self.suite = DetectorSuite(cfg.thresholds, self.policy)
        self.rank, self.primary, self.events = rank, primary, events
        self.consecutive_skips = 0
        self.rollbacks = 0
        """Rollbacks since the last checkpoint was saved."""

    # --------------------------------------------------------------------------------------------- the guard

    def controls(self, *, update_norm: bool = True) -> StepControls:
        """Bounds for the next step from the spike detectors whose action is skip or stronger. `update_norm`:
        whether the engine guards the update norm (the paged engine would need a second pass over every stage
        for it, so it does not; an update-norm spike is then logged, and its loss spike rolled back)."""
        if not self.enabled:
            return StepControls()
        bounds: dict[str, float] = {}
        for key, arg in _GUARDS.items():
            if arg == "max_update_norm" and not update_norm:
                continue
            det = self.suite.detectors.get(key)
            if det is not None and self.policy.action_for(key).strength >= Action.SKIP.strength:
                bounds[arg] = det.bound(self.suite.state[key])
        return StepControls(**bounds)

    # --------------------------------------------------------------------------------------------- observing

    def observe(self, step: int, values: dict[str, float], *, phase: Phase = Phase.TRAINING) -> Verdict:
        """Run the detectors on step `step`'s figures; write events; return what the loop must do. Raises
        TrainingDiverged when updates keep being dropped."""
        skipped = values.get("skipped", 0.0) >= 0.5
        verdict = Verdict()
        if self.enabled:
            obs = {"step": step, "phase": phase, "loss": values.get("loss"), "grad_norm": values.get("grad_norm"),
                   "update_norm": values.get("update_norm"), "step_time": values.get("perf/step_time"),
                   "host_bytes": float(psutil.Process().memory_info().rss), "device_bytes": _device_bytes()}
            for anomaly in self.suite.update(obs):
                verdict.events.append(self._record(anomaly, skipped))
                verdict.metrics[anomaly.metric_key] = 1.0
            requested = [Action(e["requested"]) for e in verdict.events
                         if e["requested"] in (Action.ROLLBACK, Action.RESTART, Action.EXCLUDE)]
            if requested:
                verdict.action = max(requested, key=lambda a: a.strength)
        if skipped:
            self.consecutive_skips += 1
            if not verdict.events:
                self._write("skipped", step=step, message=f"step {step}: the guard dropped the update "
                            f"(loss {values.get('loss')}, grad_norm {values.get('grad_norm')}, "
                            f"update_norm {values.get('update_norm')})", replicated=True)
            if self.consecutive_skips >= self.cfg.max_consecutive_skips:
                raise TrainingDiverged(
                    f"step {step}: {self.consecutive_skips} updates in a row were dropped (loss "
                    f"{values.get('loss')}, grad_norm {values.get('grad_norm')}, update_norm "
                    f"{values.get('update_norm')}; NaN/Inf or spikes): training is not making progress. Lower "
                    "optimizer.lr, check the data, or resume from an earlier checkpoint")
        else:
            self.consecutive_skips = 0
        verdict.metrics["anomaly/skipped"] = float(skipped)
        return verdict

    def _record(self, anomaly: Anomaly, skipped: bool) -> dict[str, Any]:
        requested = Action(anomaly.action)
        if requested == Action.SKIP:
            taken = "skipped" if skipped else "logged: the update was applied (the guard did not drop it)"
        elif requested == Action.LOG:
            taken = "logged" + ("; the guard dropped the update" if skipped else "")
        else:
            taken = requested.value
        event = {**anomaly.to_dict(), "requested": requested.value, "taken": taken,
                 "rank": self.rank if anomaly.detector not in _REPLICATED else None}
        event.pop("action", None)
        level = logging.WARNING if requested != Action.LOG else logging.INFO
        log.log(level, "anomaly %s at step %d -> %s: %s", anomaly.detector, anomaly.step, taken, anomaly.message)
        self._write("anomaly", replicated=anomaly.detector in _REPLICATED, **event)
        return event

    def _write(self, kind: str, *, replicated: bool, **fields: Any) -> None:
        # Figures every process shares are reported once (by process 0); local ones by every process.
        if self.events is not None and (self.primary or not replicated):
            self.events.write(kind, **fields)

    # --------------------------------------------------------------------------------------------- escalation

    def rolled_back(self, step: int, to_step: int) -> None:
        self.rollbacks += 1
        self.consecutive_skips = 0
        if self.rollbacks > self.cfg.max_rollbacks:
            raise TrainingDiverged(f"step {step}: the anomaly came back after {self.cfg.max_rollbacks} rollbacks "
                                   f"to step {to_step}; stopping. See events.jsonl")

    def checkpoint_saved(self) -> None:
        self.rollbacks = 0

    # --------------------------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        return {"suite": self.suite.to_dict()}

    def load_state_dict(self, raw: dict[str, Any]) -> None:
        """The detectors' state saved with a checkpoint (the escalation counters are not part of it)."""
        self.suite.load_dict(raw["suite"])
        self.suite.reset()  # memory detectors start over: a restore changes what the process holds

    def reset(self) -> None:
        """Every detector from scratch (the run went back to its initial state)."""
        self.suite.state = self.suite.init()


def _device_bytes() -> float | None:
    used = device_bytes_in_use(jax.local_devices()[0])
    return None if used is None else float(used)
