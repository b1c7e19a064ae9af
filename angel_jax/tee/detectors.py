"""TEE — streaming anomaly detectors over per-step, per-rank training metrics.

Every detector is a pure pair, optax style:

    det = SpikeDetector("loss_spike", "loss", LossSpikeConfig())
    state = det.init()
    state, anomaly = det.update(state, step, value)     # anomaly is an `Anomaly` or None

States are frozen dataclasses of plain values and tuples; `state.to_dict()` is JSON-ready and
`type(state).from_dict(d)` restores it (strictly), so detector states go into checkpoints. Nothing here reads a
clock, a file or a device. Thresholds live in one typed config dataclass per detector (angel_jax/config/anomaly.py);
the defaults are chosen so that clean runs give no anomaly (see tests/test_tee_detectors.py
and tests/test_tee_actions.py).

Detectors only detect: `Anomaly.action` is left None and filled in by the policy (`actions.ActionPolicy`) when a
`DetectorSuite` runs them.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from angel_jax.config.anomaly import (  # noqa: F401 - the detectors' configs, importable from here too
    AnomalyConfig,
    GradSpikeConfig,
    LossSpikeConfig,
    MemoryGrowthConfig,
    NanConfig,
    SpikeConfig,
    StepTimeConfig,
    StragglerConfig,
    UpdateSpikeConfig,
)
from angel_jax.config.fields import typed
from angel_jax.phases import Phase

Severity = Literal["info", "warning", "error", "critical"]
MAD_TO_SIGMA = 1.4826
"""MAD of a normal distribution times this is its standard deviation."""
MiB = 1 << 20


# --------------------------------------------------------------------------------------------- records


@dataclass(frozen=True)
class Anomaly:
    """One finding: which detector, where, how bad, and the numbers behind it."""

    detector: str
    step: int
    severity: Severity
    metric: str
    message: str
    value: float | None = None
    baseline: float | None = None
    threshold: float | None = None
    rank: int | None = None
    action: Any = None  # an actions.Action, filled in from the policy by the suite

    @property
    def metric_key(self) -> str:
        return f"anomaly/{self.detector}"

    def with_action(self, action: Any) -> Anomaly:
        return dataclasses.replace(self, action=action)

    def to_dict(self) -> dict:
        """Strict-JSON form for the events log (non-finite numbers become strings such as 'nan')."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for key in ("value", "baseline", "threshold"):
            if out[key] is not None and not math.isfinite(out[key]):
                out[key] = repr(float(out[key]))
        out["action"] = None if self.action is None else str(self.action)
        return out


class _State:
    """JSON round trip for the frozen state dataclasses: tuples <-> lists, types checked on the way in."""

    __slots__ = ()

    def to_dict(self) -> dict:
        return {f.name: _listify(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, raw: Any) -> Any:
        name = cls.__name__
        if not isinstance(raw, Mapping):
            raise ValueError(f"{name}: expected a mapping, got {type(raw).__name__}")
        hints = typing.get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(raw) - set(names))
        missing = [n for n in names if n not in raw]
        if unknown or missing:
            raise ValueError(f"{name}: unknown keys {unknown}, missing keys {missing}")
        return cls(**{n: typed(raw[n], hints[n], f"{name}.{n}") for n in names})


def _listify(value: Any) -> Any:
    return [_listify(v) for v in value] if isinstance(value, tuple) else value


def _median(sorted_values: typing.Sequence[float]) -> float:
    n = len(sorted_values)
    mid = n // 2
    return sorted_values[mid] if n % 2 else 0.5 * (sorted_values[mid - 1] + sorted_values[mid])


def median(values: typing.Iterable[float]) -> float:
    return _median(sorted(values))


# --------------------------------------------------------------------------------------------- NaN / Inf


@dataclass(frozen=True, slots=True)
class NanState(_State):
    count: int = 0  # non-finite steps seen so far


class NanDetector:
    """Fires on every step where one of the given values is NaN or +-Inf (None means not reported)."""

    name = "nan"

    def __init__(self, config: NanConfig = NanConfig()):
        self.config = config

    def init(self) -> NanState:
        return NanState()

    def update(self, state: NanState, step: int, values: Mapping[str, float | None]) -> tuple[NanState, Anomaly | None]:
        bad = {k: float(v) for k, v in values.items() if v is not None and not math.isfinite(float(v))}
        if not bad:
            return state, None
        metric, value = next(iter(bad.items()))
        what = ", ".join(f"{k}={v!r}" for k, v in bad.items())
        return NanState(state.count + 1), Anomaly(
            self.name, step, "critical", metric, f"non-finite {what} at step {step}", value=value)


# --------------------------------------------------------------------------------------------- spikes


@dataclass(frozen=True, slots=True)
class SpikeState(_State):
    window: tuple[float, ...] = ()  # recent healthy values (their logs with log_scale), oldest first
    pending: tuple[float, ...] = ()  # the current run of consecutive spikes (same scale)


class SpikeDetector:
    """Robust z-score spike detector (median / MAD of a rolling window of healthy values).

    Fires when value - median > max(min_abs_dev, min_rel_dev * |median|) and the robust z-score
    (value - median) / (1.4826 * MAD) > z_threshold. A spike is not added to the window, so it cannot move the
    baseline; after `rebaseline_after` spikes in a row the run is taken as a level shift and becomes the window
    (warm-up again if it is shorter than `warmup`), so a lasting change does not fire forever. Non-finite
    values are ignored here (the NaN detector reports them).
    """

    def __init__(self, name: str, metric: str, config: SpikeConfig, severity: Severity = "error"):
        self.name, self.metric, self.config, self.severity = name, metric, config, severity

    def init(self) -> SpikeState:
        return SpikeState()

    def bound(self, state: SpikeState) -> float:
        """The value above which `update(state, ...)` fires (inf during warm-up): the trainer's guard drops an
        update whose figure exceeds it, on the device, before the host has read the figure."""
        cfg = self.config
        window = state.window[-cfg.window:]
        if len(window) < cfg.warmup:
            return math.inf
        ordered = sorted(window)
        center = _median(ordered)
        sigma = MAD_TO_SIGMA * _median(sorted([abs(v - center) for v in ordered]))
        med = math.exp(center) if cfg.log_scale else center
        z_edge = center + cfg.z_threshold * sigma
        return max(med + max(cfg.min_abs_dev, cfg.min_rel_dev * abs(med)),
                   math.exp(min(z_edge, 700.0)) if cfg.log_scale else z_edge)

    def update(self, state: SpikeState, step: int, value: float | None) -> tuple[SpikeState, Anomaly | None]:
        cfg = self.config
        if value is None or not math.isfinite(value) or (cfg.log_scale and value <= 0):
            return state, None
        x = math.log(value) if cfg.log_scale else value
        window = state.window[-cfg.window:]
        if len(window) < cfg.warmup:
            return SpikeState(window + (x,), ()), None
        ordered = sorted(window)
        center = _median(ordered)
        sigma = MAD_TO_SIGMA * _median(sorted([abs(v - center) for v in ordered]))
        z = (x - center) / sigma if sigma > 0 else (math.inf if x > center else 0.0)
        med = math.exp(center) if cfg.log_scale else center
        gate = max(cfg.min_abs_dev, cfg.min_rel_dev * abs(med))
        if value - med <= gate or z <= cfg.z_threshold:
            return SpikeState((window + (x,))[-cfg.window:], ()), None
        z_edge = center + cfg.z_threshold * sigma
        threshold = max(med + gate, math.exp(z_edge) if cfg.log_scale else z_edge)
        pending = state.pending + (x,)
        scale = "log " if cfg.log_scale else ""
        message = (f"{self.metric} spike at step {step}: {value:.6g} > threshold {threshold:.6g} "
                   f"(median {med:.6g} of {len(window)}, robust {scale}z {z:.3g} > {cfg.z_threshold:g}, "
                   f"min deviation {gate:.3g})")
        if cfg.rebaseline_after and len(pending) >= cfg.rebaseline_after:
            message += f"; {len(pending)} in a row, taken as the new level (re-baselined)"
            new = SpikeState(pending[-cfg.window:], ())
        else:
            new = SpikeState(window, pending)
        return new, Anomaly(self.name, step, self.severity, self.metric, message, value, med, threshold)


# --------------------------------------------------------------------------------------------- step time


@dataclass(frozen=True, slots=True)
class StepTimeState(_State):
    window: tuple[float, ...] = ()  # recent normal step times (slow ones never enter)
    recent: tuple[bool, ...] = ()  # slow flags of the last sustain_m judged steps
    active: bool = False  # already reported this regression


class StepTimeDetector:
    """Job-wide step-time regression: k of the last m training steps slower than factor x the rolling median.

    Steps flagged with another phase (the first step, COMPILING; a checkpointing or restoring one) are ignored
    entirely. Fires once per
    episode; slow steps stay out of the baseline so a lasting regression is not absorbed into it.
    """

    name = "step_time"

    def __init__(self, config: StepTimeConfig = StepTimeConfig()):
        self.config = config

    def init(self) -> StepTimeState:
        return StepTimeState()

    def update(self, state: StepTimeState, step: int, step_time: float | None,
               phase: Phase = Phase.TRAINING) -> tuple[StepTimeState, Anomaly | None]:
        cfg = self.config
        if Phase(phase) != Phase.TRAINING or step_time is None or not math.isfinite(step_time) or step_time < 0:
            return state, None
        window = state.window[-cfg.window:]
        if len(window) < cfg.warmup:
            return StepTimeState(window + (step_time,), (), False), None
        med = median(window)
        threshold = max(cfg.factor * med, med + cfg.min_excess_s)
        slow = step_time > threshold
        recent = (state.recent + (slow,))[-cfg.sustain_m:]
        if not slow:
            window = (window + (step_time,))[-cfg.window:]
        count = sum(recent)
        if count < cfg.sustain_k:
            return StepTimeState(window, recent, False), None
        if state.active:
            return StepTimeState(window, recent, True), None
        message = (f"step time regression at step {step}: {step_time:.4g}s; {count} of the last {len(recent)} steps "
                   f"> {threshold:.4g}s ({cfg.factor:g}x baseline median {med:.4g}s)")
        return StepTimeState(window, recent, True), Anomaly(
            self.name, step, "warning", "step_time", message, step_time, med, threshold)


# --------------------------------------------------------------------------------------------- stragglers


@dataclass(frozen=True, slots=True)
class StragglerState(_State):
    ranks: tuple[tuple[int, int, tuple[bool, ...]], ...] = ()  # (rank, last step seen, slow flags), by rank
    active: tuple[int, ...] = ()  # ranks already reported in their current episode


class StragglerDetector:
    """Per step, rank -> step time; a rank slower than factor x the median of ranks in k of its last m steps.

    Feed each rank's own time (compute before the collective wait, or its heartbeat interval): in synchronous
    data parallelism the wall time of a whole step is the same on every rank. Reports one rank per step (the
    one with most slow steps, then the slowest); another straggler is reported on the next step.
    """

    name = "straggler"

    def __init__(self, config: StragglerConfig = StragglerConfig()):
        self.config = config

    def init(self) -> StragglerState:
        return StragglerState()

    def update(self, state: StragglerState, step: int,
               times: Mapping[int, float | None]) -> tuple[StragglerState, Anomaly | None]:
        cfg = self.config
        valid = {int(r): float(t) for r, t in times.items() if t is not None and math.isfinite(t) and t >= 0}
        history = {r: (seen, flags) for r, seen, flags in state.ranks if step - seen <= cfg.sustain_m}
        active = {r for r in state.active if r in history}
        judged = len(valid) >= cfg.min_ranks
        med = median(valid.values()) if judged else 0.0
        threshold = max(cfg.factor * med, med + cfg.min_excess_s)
        if judged:
            for r, t in valid.items():
                history[r] = (step, (history.get(r, (step, ()))[1] + (t > threshold,))[-cfg.sustain_m:])
        candidates = []
        for r, (_, flags) in history.items():
            if sum(flags) < cfg.sustain_k:
                active.discard(r)
            elif judged and r in valid and r not in active:
                candidates.append((-sum(flags), -valid[r], r))
        anomaly = None
        if candidates:
            _, _, r = min(candidates)
            flags = history[r][1]
            active.add(r)
            message = (f"straggler rank {r} at step {step}: {valid[r]:.4g}s > {threshold:.4g}s "
                       f"({cfg.factor:g}x median {med:.4g}s of {len(valid)} ranks) in {sum(flags)} of its "
                       f"last {len(flags)} steps")
            anomaly = Anomaly(self.name, step, "warning", "step_time", message, valid[r], med, threshold, rank=r)
        ranks = tuple((r, seen, flags) for r, (seen, flags) in sorted(history.items()))
        return StragglerState(ranks, tuple(sorted(active))), anomaly


# --------------------------------------------------------------------------------------------- memory growth


@dataclass(frozen=True, slots=True)
class MemoryState(_State):
    seen: int = 0  # observations counted towards the warm-up (stops at warmup)
    steps: tuple[int, ...] = ()
    values: tuple[float, ...] = ()
    active: bool = False  # already reported this growth episode


def _slope(xs: typing.Sequence[int], ys: typing.Sequence[float]) -> float:
    """Least-squares slope of ys against integer xs (sums of products; xs exact, ys shifted by ys[0])."""
    n, y0 = len(xs), ys[0]
    ys = [y - y0 for y in ys]
    sx, sy = sum(xs), sum(ys)
    sxx = n * sum(map(operator.mul, xs, xs)) - sx * sx
    return (n * sum(map(operator.mul, xs, ys)) - sx * sy) / sxx if sxx > 0 else 0.0


class MemoryGrowthDetector:
    """Leak trend: bytes grow steadily over a full window of observations.

    The least-squares slope is fitted separately to the older and the recent half of the window, and the
    *smaller* slope, projected over the window's span of steps, must exceed both thresholds. A leak grows in
    both halves; a one-off jump that then stays flat (a cache filling, a buffer allocated once) shows in at
    most one half, and a curve that is levelling off grows less in the recent half, so neither fires. The price:
    a leak must last a whole window before it is reported. Fires once per episode.
    """

    name = "memory_growth"

    def __init__(self, metric: str = "host_bytes", config: MemoryGrowthConfig = MemoryGrowthConfig()):
        self.metric, self.config = metric, config

    def init(self) -> MemoryState:
        return MemoryState()

    def update(self, state: MemoryState, step: int, nbytes: float | None) -> tuple[MemoryState, Anomaly | None]:
        cfg = self.config
        if nbytes is None or not math.isfinite(nbytes) or nbytes < 0:
            return state, None
        if state.seen < cfg.warmup:
            return MemoryState(state.seen + 1), None
        steps = (state.steps + (int(step),))[-cfg.window:]
        values = (state.values + (float(nbytes),))[-cfg.window:]
        if len(steps) < cfg.window:
            return MemoryState(state.seen, steps, values, False), None
        half = len(steps) // 2
        span = steps[-1] - steps[0]
        level = sum(values[:half]) / half
        threshold = max(cfg.min_growth_bytes, cfg.min_growth_fraction * level)
        new = _slope(steps[half:], values[half:])
        old = _slope(steps[:half], values[:half]) if new * span > threshold else 0.0  # skip when it cannot fire
        growth = min(old, new) * span
        if growth <= threshold:
            return MemoryState(state.seen, steps, values, False), None
        if state.active:
            return MemoryState(state.seen, steps, values, True), None
        message = (f"{self.metric} growing at step {step}: {old / MiB:.3g} then {new / MiB:.3g} MiB/step, "
                   f"{growth / MiB:.4g} MiB projected over {span} steps > threshold {threshold / MiB:.4g} MiB "
                   f"(max of {cfg.min_growth_bytes / MiB:.4g} MiB and {cfg.min_growth_fraction:.1%} of "
                   f"{level / MiB:.5g} MiB)")
        return MemoryState(state.seen, steps, values, True), Anomaly(
            self.name, step, "error", self.metric, message, growth, level, threshold)


# --------------------------------------------------------------------------------------------- all thresholds


