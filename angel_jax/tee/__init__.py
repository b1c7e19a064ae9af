"""TRANSOM TEE: streaming anomaly detectors (pure init/update pairs), the suites that run them and map findings
to actions, and the events log. Nothing here reads a clock, a device or a model; the trainer and the watchdog
feed the suites and act on what they return."""

from angel_jax.tee.actions import CrossRankSuite, DetectorSuite, strongest
from angel_jax.tee.detectors import (
    Anomaly,
    MemoryGrowthDetector,
    NanDetector,
    SpikeDetector,
    StepTimeDetector,
    StragglerDetector,
)

__all__ = [
    "Anomaly", "CrossRankSuite", "DetectorSuite", "MemoryGrowthDetector", "NanDetector",
    "SpikeDetector", "StepTimeDetector", "StragglerDetector", "strongest",
]
