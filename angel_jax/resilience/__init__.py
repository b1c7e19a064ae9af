"""TRANSOM TOL + TEE: heartbeats, anomaly detectors, watchdog coordinator, restart policy.

The watchdog's entry points (`angel-jax launch`: launch.py; `angel-jax worker`: worker.py) are not imported here:
they pull in the config and JAX, and angel_jax.config itself imports this package.
"""

from angel_jax.resilience.actions import Action, ActionPolicy, CrossRankSuite, DetectorSuite, strongest
from angel_jax.resilience.coordinator import (
    AnomalyReport,
    CoordinatorDetector,
    State,
    Watchdog,
    WatchdogPolicy,
    describe_status,
    hang_timeout,
)
from angel_jax.resilience.detectors import (
    Anomaly,
    AnomalyConfig,
    GradSpikeConfig,
    UpdateSpikeConfig,
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
from angel_jax.resilience.goodput import format_report, goodput
from angel_jax.resilience.heartbeat import HeartbeatClient, HeartbeatServer

__all__ = [
    "AnomalyReport", "CoordinatorDetector", "HeartbeatClient", "HeartbeatServer", "State", "Watchdog",
    "WatchdogPolicy", "describe_status", "format_report", "goodput", "hang_timeout",
    "Action", "ActionPolicy", "Anomaly", "AnomalyConfig", "CrossRankSuite", "DetectorSuite", "GradSpikeConfig",
    "HangConfig", "HangDetector", "LossSpikeConfig", "MemoryGrowthConfig", "MemoryGrowthDetector", "NanConfig",
    "NanDetector", "SpikeConfig", "SpikeDetector", "StepTimeConfig", "StepTimeDetector", "StragglerConfig",
    "StragglerDetector", "UpdateSpikeConfig", "strongest",
]
