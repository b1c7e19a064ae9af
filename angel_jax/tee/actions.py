"""TEE -> TOL: what to do about an anomaly, and the suites that run the detectors.

    suite = DetectorSuite(AnomalyConfig(), ActionPolicy.from_dict({"step_time": "log"}))
    for anomaly in suite.update({"step": 12, "loss": 2.31, "grad_norm": 0.8, "step_time": 0.41, "phase": "training"}):
        ...  # anomaly.action is an Action; strongest(anomalies) is the one to act on
    ckpt_extra["tee"] = suite.to_dict()        # JSON; DetectorSuite.from_dict(...) on restore

`DetectorSuite` runs the per-step detectors inside a worker (NaN, loss / gradient-norm / update-norm spikes,
step-time regression, host and device memory growth); `CrossRankSuite` runs the straggler detector on the
coordinator's heartbeat data. Both are thin stateful shells around the pure detectors: `step(state, obs)`
is the pure form, `update(obs)` keeps the state in the object.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping
from typing import Any

from angel_jax.config.anomaly import Action, ActionPolicy  # noqa: F401 - importable from here too
from angel_jax.phases import Phase
from angel_jax.tee.detectors import (
    AnomalyConfig,
    Anomaly,
    MemoryGrowthDetector,
    NanDetector,
    SpikeDetector,
    StepTimeDetector,
    StragglerDetector,
)


def strongest(anomalies: Iterable[Anomaly]) -> Action | None:
    """The strongest action among anomalies (None when there are none)."""
    actions = [Action(a.action) for a in anomalies if a.action is not None]
    return max(actions, key=lambda a: a.strength) if actions else None


# --------------------------------------------------------------------------------------------- suites


def _real(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"observation {key!r}: expected a number, got {type(value).__name__} {value!r}")
    return float(value)


def _rank_map(key: str, value: Any) -> dict[int, float]:
    if not isinstance(value, Mapping):
        raise ValueError(f"observation {key!r}: expected a mapping rank -> number, got {value!r}")
    out = {}
    for rank, t in value.items():
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral):
            raise ValueError(f"observation {key!r}: rank {rank!r} is not an int")
        out[int(rank)] = _real(f"{key}[{rank}]", t)
    return out


class _Suite:
    FORMAT = "angel_jax.tee/1"
    KEYS: tuple[str, ...] = ()  # observation keys
    KEYS_ALL: tuple[str, ...] = ()  # detector state keys
    PROCESS_LOCAL: tuple[str, ...] = ()

    def __init__(self, config: AnomalyConfig | None = None, policy: ActionPolicy | None = None):
        self.config = config if config is not None else AnomalyConfig()
        self.policy = policy if policy is not None else ActionPolicy()
        for key, problem in self.config.validate():
            raise ValueError(f"anomaly config {key!r}: {problem}")
        self.detectors = self._build()
        for det in self.detectors.values():
            self.policy.action_for(det.name)
        self.state = self.init()

    def _build(self) -> dict[str, Any]:
        raise NotImplementedError

    def _args(self, key: str, obs: dict) -> tuple | None:
        raise NotImplementedError

    def _check(self, obs: Mapping[str, Any]) -> dict:
        if not isinstance(obs, Mapping):
            raise ValueError(f"observation: expected a mapping, got {type(obs).__name__}")
        for key in obs:
            if key not in self.KEYS:
                raise ValueError(f"observation: unknown key {key!r}; known: {', '.join(self.KEYS)}")
        out = {k: v for k, v in obs.items() if v is not None}
        step = out.get("step")
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise ValueError(f"observation 'step': expected an int, got {step!r}")
        out["step"] = int(step)
        phase = out.setdefault("phase", Phase.TRAINING)
        if phase not in set(Phase):
            raise ValueError(f"observation 'phase': {phase!r} is not one of {', '.join(Phase)}")
        out["phase"] = Phase(phase)
        return out

    def init(self) -> dict[str, Any]:
        return {key: det.init() for key, det in self.detectors.items()}

    def step(self, state: Mapping[str, Any], obs: Mapping[str, Any]) -> tuple[dict[str, Any], list[Anomaly]]:
        """Pure: (state, observation) -> (new state, anomalies with the policy's action)."""
        obs = self._check(obs)
        new, found = dict(state), []
        for key, det in self.detectors.items():
            args = self._args(key, obs)
            if args is None:
                continue
            new[key], anomaly = det.update(state[key], *args)
            if anomaly is not None:
                found.append(anomaly.with_action(self.policy.action_for(anomaly.detector)))
        return new, found

    def update(self, obs: Mapping[str, Any]) -> list[Anomaly]:
        self.state, found = self.step(self.state, obs)
        return found

    def reset(self, *keys: str) -> None:
        """Start the named detectors (default: the process-local ones, e.g. memory after a restart) afresh."""
        for key in keys or self.PROCESS_LOCAL:
            if key in self.detectors:
                self.state[key] = self.detectors[key].init()
            elif key not in self.KEYS_ALL:
                raise ValueError(f"unknown detector state {key!r}; known: {', '.join(self.KEYS_ALL)}")

    def to_dict(self) -> dict:
        return {"format": self.FORMAT, "states": {k: s.to_dict() for k, s in self.state.items()}}

    def load_dict(self, raw: Any) -> None:
        """Restore states saved by to_dict. A detector absent from `raw` starts fresh (it was disabled when
        saved); a state for a detector now disabled is ignored; a malformed state raises ValueError."""
        ok = isinstance(raw, Mapping) and raw.get("format") == self.FORMAT and isinstance(raw.get("states"), Mapping)
        if not ok:
            raise ValueError(f"detector suite state: expected {{'format': {self.FORMAT!r}, 'states': {{...}}}}")
        state = self.init()
        for key, det in self.detectors.items():
            if key in raw["states"]:
                try:
                    state[key] = type(det.init()).from_dict(raw["states"][key])
                except ValueError as e:
                    raise ValueError(f"detector suite state {key!r}: {e}") from None
        self.state = state

    @classmethod
    def from_dict(cls, raw: Any, config: AnomalyConfig | None = None, policy: ActionPolicy | None = None):
        suite = cls(config, policy)
        suite.load_dict(raw)
        return suite


class DetectorSuite(_Suite):
    """Per-step detectors inside a worker. Observation keys (all but 'step' optional; a missing or None value
    skips the detectors that need it): step, loss, grad_norm, update_norm, step_time, phase, host_bytes,
    device_bytes. `reset()` after a process restart: memory detectors start over (a new process re-warms)."""

    KEYS = ("step", "loss", "grad_norm", "update_norm", "step_time", "phase", "host_bytes", "device_bytes")
    KEYS_ALL = ("nan", "loss_spike", "grad_spike", "update_spike", "step_time", "host_memory", "device_memory")
    PROCESS_LOCAL = ("host_memory", "device_memory")
    _SPIKES = {"loss_spike": "loss", "grad_spike": "grad_norm", "update_spike": "update_norm"}
    _MEMORY = {"host_memory": "host_bytes", "device_memory": "device_bytes"}

    def _build(self) -> dict[str, Any]:
        c = self.config
        dets = {
            "nan": NanDetector(c.nan),
            "loss_spike": SpikeDetector("loss_spike", "loss", c.loss_spike, "error"),
            "grad_spike": SpikeDetector("grad_spike", "grad_norm", c.grad_spike, "warning"),
            "update_spike": SpikeDetector("update_spike", "update_norm", c.update_spike, "warning"),
            "step_time": StepTimeDetector(c.step_time),
            "host_memory": MemoryGrowthDetector("host_bytes", c.memory_growth),
            "device_memory": MemoryGrowthDetector("device_bytes", c.memory_growth),
        }
        return {key: det for key, det in dets.items() if det.config.enabled}

    def _check(self, obs: Mapping[str, Any]) -> dict:
        out = super()._check(obs)
        for key in ("loss", "grad_norm", "update_norm", "step_time", "host_bytes", "device_bytes"):
            if key in out:
                out[key] = _real(key, out[key])
        return out

    def _args(self, key: str, obs: dict) -> tuple | None:
        step = obs["step"]
        if key == "nan":
            values = {k: obs[k] for k in ("loss", "grad_norm", "update_norm") if k in obs}
            return (step, values) if values else None
        metric = self._SPIKES.get(key) or self._MEMORY.get(key)
        if metric is not None:
            return (step, obs[metric]) if metric in obs else None
        return (step, obs["step_time"], obs["phase"]) if "step_time" in obs else None


class CrossRankSuite(_Suite):
    """The straggler detector on the coordinator. Observation keys: step (required), rank_step_times (rank ->
    seconds), phase. Hangs are the watchdog's own judgement (its progress timeout, resilience.hang_*), not a
    detector here."""

    KEYS = ("step", "rank_step_times", "phase")
    KEYS_ALL = ("straggler",)

    def _build(self) -> dict[str, Any]:
        det = StragglerDetector(self.config.straggler)
        return {"straggler": det} if det.config.enabled else {}

    def _check(self, obs: Mapping[str, Any]) -> dict:
        out = super()._check(obs)
        if "rank_step_times" in out:
            out["rank_step_times"] = _rank_map("rank_step_times", out["rank_step_times"])
        return out

    def _args(self, key: str, obs: dict) -> tuple | None:
        return (obs["step"], obs["rank_step_times"]) if "rank_step_times" in obs else None
