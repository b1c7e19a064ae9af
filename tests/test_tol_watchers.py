"""Coordinator-side detectors (watchers.py) on the ranks' heartbeat view."""

from __future__ import annotations

from angel_jax.tol import coordinator as co


def test_straggler_is_found_from_busy_times_not_step_times():
    """Synchronous data parallelism: both ranks report the same step time; rank 1's busy time (its time outside
    waiting for the device) is 3x: the straggler watch names rank 1 once 8 of its last 10 steps were slow."""
    from angel_jax.tee.actions import ActionPolicy, CrossRankSuite
    from angel_jax.tee.detectors import AnomalyConfig
    from angel_jax.tol.watchers import CrossRankWatch

    watch = CrossRankWatch(CrossRankSuite(AnomalyConfig(), ActionPolicy()))
    views = {r: co.RankView(rank=r, node=f"local{r}", pid=10 + r, spawned=0.0, last_progress=0.0) for r in (0, 1)}
    found = []
    for step in range(1, 13):
        for r, busy in ((0, 0.02), (1, 0.30)):
            views[r].step_times[step] = 0.31  # the same wall time on every rank
            views[r].busy_times[step] = busy
        found += watch.observe(float(step), views)
    assert [(a.detector, a.rank, a.step, a.action) for a in found] == [("straggler", 1, 8, "log")]
    quiet = CrossRankWatch(CrossRankSuite(AnomalyConfig(), ActionPolicy()))
    for r in (0, 1):
        views[r].busy_times = {s: 0.02 for s in range(1, 13)}
    assert quiet.observe(13.0, views) == []
