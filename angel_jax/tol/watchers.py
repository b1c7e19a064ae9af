"""Coordinator-side detectors: anomaly detection on the heartbeats of every rank (TEE on the watchdog's side).

A watcher implements `coordinator.CoordinatorDetector`: on every tick it reads the ranks' view (step, phase, the
step time of each recent step, ...) and returns `AnomalyReport`s; the watchdog logs them, and recovers when one's
action is restart or exclude, exactly as for a report a worker's own detectors send in a heartbeat.

    CrossRankWatch   angel_jax.tee.actions.CrossRankSuite's straggler detector, fed each step's per-rank
                     busy time (perf/busy_time: the time a rank spends outside waiting for the device) once every
                     live rank has reported that step. In synchronous data parallelism every rank's step time is
                     the same (the fast ones wait in the collective); the busy time shows which rank the others
                     waited for, when its slowness is on the host (data, hooks, a loaded CPU). A rank whose device
                     is slow inside the collective step does not show there. Hangs are judged by the watchdog's
                     progress timeout (resilience.hang_*), the one hang detector.
"""

from __future__ import annotations

from typing import Mapping

from angel_jax.config import Config
from angel_jax.phases import Phase
from angel_jax.tee.actions import ActionPolicy, CrossRankSuite
from angel_jax.tol.coordinator import AnomalyReport, CoordinatorDetector, RankView


class CrossRankWatch:
    """Feeds a CrossRankSuite with the step times the heartbeats carry, one step at a time, in order."""

    def __init__(self, suite: CrossRankSuite):
        self.suite = suite
        self.last: int | None = None
        self._attempt_key: tuple | None = None

    def observe(self, now: float, ranks: Mapping[int, RankView]) -> list[AnomalyReport]:
        live = [v for v in ranks.values() if v.exited is None]
        if len(live) < 2:
            return []
        key = tuple((v.rank, v.spawned) for v in ranks.values())
        if key != self._attempt_key:  # a new group: steps repeat from the checkpoint, processes are new
            self._attempt_key, self.last = key, None
            self.suite.state = self.suite.init()
        common = set(live[0].busy_times).intersection(*(v.busy_times for v in live[1:]))
        reports = []
        for step in sorted(s for s in common if self.last is None or s > self.last):
            obs = {"step": step, "rank_step_times": {v.rank: v.busy_times[step] for v in live}, "phase": Phase.TRAINING}
            for a in self.suite.update(obs):
                reports.append(AnomalyReport(now, a.detector, str(a.action), a.rank, a.step, a.message))
            self.last = step
        return reports


def default_detectors(cfg: Config) -> list[CoordinatorDetector]:
    """The coordinator-side detectors a config asks for (none when anomaly detection is off)."""
    if not cfg.anomaly.enabled:
        return []
    suite = CrossRankSuite(cfg.anomaly.thresholds, ActionPolicy.from_dict(cfg.anomaly.actions))
    return [CrossRankWatch(suite)] if suite.detectors else []
