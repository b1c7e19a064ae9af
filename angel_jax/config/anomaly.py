"""The anomaly detectors' thresholds (TEE) and the actions taken on what they find: typed configs, one per
detector, and the detector -> action policy. The detectors themselves (angel_jax/tee/detectors.py) are pure
functions of these configs; the defaults are chosen so that clean runs give no anomaly (tests/test_tee_detectors.py,
tests/test_tee_actions.py, experiments/bench/false_positives.py)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from angel_jax.config.fields import check, doc, sub

MiB = 1 << 20


@dataclass(frozen=True)
class NanConfig:
    enabled: bool = doc(True, "Report NaN/Inf in the loss, gradient norm or update norm (fires at once).")

    def validate(self) -> list[tuple[str, str]]:
        return []


@dataclass(frozen=True)
class SpikeConfig:
    enabled: bool = doc(True, "Run this detector.")
    window: int = doc(100, "Recent healthy values kept as the baseline (median and MAD); spikes never enter it.")
    warmup: int = doc(20, "No judgement until the window holds this many values (all values enter it until then).")
    z_threshold: float = doc(8.0, "Fire when (value - median) / (1.4826 * MAD) exceeds this (one-sided: upward).")
    min_rel_dev: float = doc(0.2, "... and value - median also exceeds this fraction of |median| ...")
    min_abs_dev: float = doc(1e-3, "... and this absolute amount, so a flat plateau (MAD ~ 0) does not fire on noise.")
    rebaseline_after: int = doc(10, "After this many spikes in a row, accept them as the new level (0 = never).")
    log_scale: bool = doc(False, "Compute median, MAD and z on log(value) (multiplicative noise, e.g. norms).")

    def validate(self) -> list[tuple[str, str]]:
        errs: list = []
        check(errs, self.window >= 1, "window", "must be >= 1")
        check(errs, 1 <= self.warmup <= self.window, "warmup", f"must be in [1, window={self.window}]")
        check(errs, self.z_threshold > 0, "z_threshold", "must be > 0")
        check(errs, self.min_rel_dev >= 0, "min_rel_dev", "must be >= 0")
        check(errs, self.min_abs_dev >= 0, "min_abs_dev", "must be >= 0")
        check(errs, 0 <= self.rebaseline_after <= self.window, "rebaseline_after",
               f"must be in [0, window={self.window}]")
        return errs


@dataclass(frozen=True)
class LossSpikeConfig(SpikeConfig):
    """Loss: noise of a few % around a trend; a spike worth a rollback is > 20% above the median and > 8 sigmas."""


@dataclass(frozen=True)
class GradSpikeConfig(SpikeConfig):
    """Gradient norms: multiplicative, heavy-tailed noise, so judged on log scale. Clean runs of the main job
    reach 4.3x their median gradient norm (robust log z 6.6) within 300 steps, and with clipping such a step is
    a normal-sized update; so only a jump to > 10x the median and > 6 robust sigmas of log(norm) fires."""

    z_threshold: float = doc(6.0, "Fire when the robust z of log(value) exceeds this (one-sided: upward).")
    min_rel_dev: float = doc(9.0, "... and value - median also exceeds this multiple of the median ...")
    min_abs_dev: float = doc(1e-8, "... and this absolute amount.")
    log_scale: bool = doc(True, "Compute median, MAD and z on log(value).")


@dataclass(frozen=True)
class UpdateSpikeConfig(GradSpikeConfig):
    """Update norms: the optimizer's step, bounded by the learning rate (Adam-like updates barely follow the
    gradient's size), so much steadier than gradient norms: a jump to > 2x the median and > 6 robust sigmas of
    log(norm) fires (a learning-rate blow-up)."""

    min_rel_dev: float = doc(1.0, "... and value - median also exceeds this multiple of the median ...")


@dataclass(frozen=True)
class StepTimeConfig:
    enabled: bool = doc(True, "Run this detector.")
    window: int = doc(100, "Recent normal training step times kept as the baseline (their median).")
    warmup: int = doc(20, "No judgement until the window holds this many step times.")
    factor: float = doc(1.5, "A step is slow when its time exceeds factor x the baseline median ...")
    min_excess_s: float = doc(0.01, "... and the median by at least this many seconds (millisecond steps jitter).")
    sustain_k: int = doc(8, "Fire when at least k of ...")
    sustain_m: int = doc(10, "... the last m judged steps were slow; re-armed once fewer than k are.")

    def validate(self) -> list[tuple[str, str]]:
        errs: list = []
        check(errs, self.window >= 1, "window", "must be >= 1")
        check(errs, 1 <= self.warmup <= self.window, "warmup", f"must be in [1, window={self.window}]")
        check(errs, self.factor > 1, "factor", "must be > 1")
        check(errs, self.min_excess_s >= 0, "min_excess_s", "must be >= 0")
        check(errs, self.sustain_m >= 1, "sustain_m", "must be >= 1")
        check(errs, 1 <= self.sustain_k <= self.sustain_m, "sustain_k", f"must be in [1, sustain_m={self.sustain_m}]")
        return errs


@dataclass(frozen=True)
class StragglerConfig:
    enabled: bool = doc(True, "Run this detector (cross-rank, on the coordinator).")
    factor: float = doc(1.5, "A rank is slow in a step when its time exceeds factor x the median of all ranks ...")
    min_excess_s: float = doc(0.01, "... and that median by at least this many seconds.")
    sustain_k: int = doc(8, "Fire for a rank slow in at least k of ...")
    sustain_m: int = doc(10, "... its last m steps; re-armed once fewer than k are; forgotten after m unseen steps.")
    min_ranks: int = doc(2, "Judge a step only when at least this many ranks reported a time for it.")

    def validate(self) -> list[tuple[str, str]]:
        errs: list = []
        check(errs, self.factor > 1, "factor", "must be > 1")
        check(errs, self.min_excess_s >= 0, "min_excess_s", "must be >= 0")
        check(errs, self.sustain_m >= 1, "sustain_m", "must be >= 1")
        check(errs, 1 <= self.sustain_k <= self.sustain_m, "sustain_k", f"must be in [1, sustain_m={self.sustain_m}]")
        check(errs, self.min_ranks >= 2, "min_ranks", "must be >= 2")
        return errs


@dataclass(frozen=True)
class MemoryGrowthConfig:
    enabled: bool = doc(True, "Run this detector (host and device bytes separately).")
    window: int = doc(200, "Observations in the trend window (least-squares slope of bytes vs step).")
    warmup: int = doc(100, "Observations ignored after start (allocators and caches fill up first).")
    min_growth_bytes: float = doc(256.0 * MiB, "Fire when the growth projected over the window exceeds this ...")
    min_growth_fraction: float = doc(0.02, "... and this fraction of the level at the start of the window.")

    def validate(self) -> list[tuple[str, str]]:
        errs: list = []
        check(errs, self.window >= 4, "window", "must be >= 4")
        check(errs, self.warmup >= 0, "warmup", "must be >= 0")
        check(errs, self.min_growth_bytes > 0, "min_growth_bytes", "must be > 0")
        check(errs, self.min_growth_fraction >= 0, "min_growth_fraction", "must be >= 0")
        return errs


@dataclass(frozen=True)
class AnomalyConfig:
    nan: NanConfig = sub(NanConfig, "NaN/Inf in loss, gradient norm, update norm.")
    loss_spike: LossSpikeConfig = sub(LossSpikeConfig, "Loss spikes (robust z-score).")
    grad_spike: GradSpikeConfig = sub(GradSpikeConfig, "Gradient-norm spikes (robust z-score).")
    update_spike: UpdateSpikeConfig = sub(UpdateSpikeConfig, "Update-norm spikes (robust z-score).")
    step_time: StepTimeConfig = sub(StepTimeConfig, "Job-wide step-time regression.")
    straggler: StragglerConfig = sub(StragglerConfig, "Straggler ranks (coordinator).")
    memory_growth: MemoryGrowthConfig = sub(MemoryGrowthConfig, "Host/device memory leak trends.")

    def validate(self) -> list[tuple[str, str]]:
        return [(f"{f.name}.{key}", problem) for f in dataclasses.fields(self)
                for key, problem in getattr(self, f.name).validate()]


# --------------------------------------------------------------------------------------------- actions


class Action(enum.StrEnum):
    """What the trainer / coordinator does, weakest first."""

    LOG = "log"  # record it, carry on
    SKIP = "skip"  # drop this batch's update
    ROLLBACK = "rollback"  # restore the last good checkpoint and skip the data window since
    RESTART = "restart"  # stop the whole group and restart from the last good checkpoint
    EXCLUDE = "exclude"  # restart without the node of the named rank

    @property
    def strength(self) -> int:
        return list(Action).index(self)


@dataclass(frozen=True)
class ActionPolicy:
    """Detector name -> Action. Defaults: act as little as fixes the problem.

    straggler defaults to `log`, not `exclude`: excluding a node forces a full restart (lost progress since the
    last checkpoint plus start-up and compile), changes the world size, and a rank that is slow for k of m steps
    is often transiently slow (a checkpoint persisting on that host, a noisy neighbour). Opt in with
    `straggler: exclude` together with a longer `straggler.sustain_m` when spare nodes exist.
    """

    nan: Action = doc(Action.ROLLBACK, "NaN/Inf: the state may already be poisoned; go back to a good checkpoint.")
    loss_spike: Action = doc(Action.ROLLBACK, "Loss spike: roll back and skip the data window (PaLM-style).")
    grad_spike: Action = doc(Action.SKIP, "Gradient-norm spike: drop this batch's update.")
    update_spike: Action = doc(Action.SKIP, "Update-norm spike: drop this batch's update.")
    step_time: Action = doc(Action.LOG, "Job-wide slowdown: nothing a restart reliably fixes; report it.")
    straggler: Action = doc(Action.LOG, "Straggler rank: report (see the class doc for why not exclude).")
    memory_growth: Action = doc(Action.RESTART, "Leak: restart before it runs out of memory.")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ActionPolicy:
        """Strict: an unknown detector or action raises ValueError naming it; absent detectors keep defaults."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"action policy: expected a mapping of detector -> action, got {raw!r}")
        known = cls.names()
        actions = ", ".join(a.value for a in Action)
        kwargs = {}
        for key, value in raw.items():
            if key not in known:
                raise ValueError(f"action policy: unknown detector {key!r}; known: {', '.join(known)}")
            if not isinstance(value, str) or value not in {a.value for a in Action}:
                raise ValueError(f"action policy: unknown action {value!r} for detector {key!r}; known: {actions}")
            kwargs[key] = Action(value)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, str]:
        return {name: getattr(self, name).value for name in self.names()}

    def action_for(self, detector: str) -> Action:
        if detector not in self.names():
            raise ValueError(f"action policy: unknown detector {detector!r}; known: {', '.join(self.names())}")
        return getattr(self, detector)
