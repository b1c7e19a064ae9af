"""TRANSOM TOL + TEE: heartbeats, anomaly detectors, watchdog coordinator, restart policy."""

from angel_jax.resilience.actions import Action, ActionPolicy, CrossRankSuite, DetectorSuite, strongest
from angel_jax.resilience.detectors import (
    Anomaly,
    AnomalyConfig,
    GradSpikeConfig,
    HangConfig,
    HangDetector,
    LossSpikeConfig,
    MemoryGrowthConfig,
    MemoryGrowthDetector,
    NanConfig,
    NanDetector,
    SpikeConfig,
    SpikeDetector,
    StepTimeConfig,
    StepTimeDetector,
    StragglerConfig,
    StragglerDetector,
)

__all__ = [
    "Action", "ActionPolicy", "Anomaly", "AnomalyConfig", "CrossRankSuite", "DetectorSuite", "GradSpikeConfig",
    "HangConfig", "HangDetector", "LossSpikeConfig", "MemoryGrowthConfig", "MemoryGrowthDetector", "NanConfig",
    "NanDetector", "SpikeConfig", "SpikeDetector", "StepTimeConfig", "StepTimeDetector", "StragglerConfig",
    "StragglerDetector", "strongest",
]
