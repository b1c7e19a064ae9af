"""The goodput report (goodput.py) from events with exact values: every instant gets one label, overlaps go to
the higher priority.
"""

from __future__ import annotations

import pytest

from angel_jax.tol.goodput import CATEGORIES, goodput, paint


def _ev(t: float, kind: str, **fields) -> dict:
    return {"time": t, "kind": kind, "source": "watchdog", **fields}


def test_goodput_categories_with_exact_values():
    events = [
        _ev(100.0, "job_start"),
        _ev(101.0, "start", attempt=0),
        _ev(102.0, "phase", attempt=0, phase="setup", step=0),
        _ev(103.0, "phase", attempt=0, phase="restoring", step=0),
        _ev(104.0, "phase", attempt=0, phase="compiling", step=0),
        _ev(110.0, "first_step", attempt=0, step=1),
        _ev(110.0, "phase", attempt=0, phase="training", step=1),
        _ev(115.0, "phase", attempt=0, phase="checkpointing", step=4),
        _ev(116.0, "checkpoint", attempt=0, step=4, stall_s=1.0),
        _ev(116.0, "phase", attempt=0, phase="training", step=4),
        _ev(120.0, "hang", attempt=0, rank=1, silent_s=5.0, fatal=True),
        _ev(121.0, "stopped", attempt=0),
        _ev(121.5, "restart", attempt=1),
        _ev(122.0, "start", attempt=1),
        _ev(123.0, "phase", attempt=1, phase="restoring", step=4),
        _ev(125.0, "phase", attempt=1, phase="compiling", step=4),
        _ev(126.0, "resumed", attempt=1, step=4, lost_steps=2),
        _ev(128.0, "first_step", attempt=1, step=5),
        _ev(128.0, "phase", attempt=1, phase="training", step=5),
        _ev(138.0, "last_step", attempt=1, step=16),
        _ev(138.0, "phase", attempt=1, phase="checkpointing", step=16),
        _ev(139.0, "phase", attempt=1, phase="training", step=16),
        _ev(141.0, "job_end", state="succeeded"),
    ]
    r = goodput(events)
    # The hang started at the last progress, 120 - 5 = 115 (entering the checkpoint), so detection and recovery is
    # 115..122 and takes that checkpoint's stall too; nothing lies between the resumed checkpoint (116) and the
    # fault, so no lost progress. Start-up: 100..101, 101..110 less the restore 103..104, 122..128 less the restore
    # 123..125 = 13. Shutdown: 138..141 less the final checkpoint's stall 138..139.
    assert r["badput_s"] == {"detection_recovery": 7.0, "lost_progress": 0.0, "restore": 3.0,
                             "checkpoint_stall": 1.0, "startup_compile": 13.0, "shutdown": 2.0}
    assert r["productive_s"] == 5.0 + 10.0 and r["wall_s"] == 41.0  # training 110..115 and 128..138
    assert r["productive_s"] + sum(r["badput_s"].values()) == pytest.approx(r["wall_s"])
    assert r["goodput"] == round(15.0 / 41.0, 4) and (r["attempts"], r["restarts"], r["lost_steps"]) == (2, 1, 2)


def test_goodput_lost_progress_since_the_resumed_checkpoint():
    events = [_ev(0.0, "job_start"), _ev(0.0, "start", attempt=0), _ev(2.0, "first_step", attempt=0, step=1),
              _ev(4.0, "phase", attempt=0, phase="checkpointing", step=4),
              _ev(4.5, "checkpoint", attempt=0, step=4, stall_s=0.5),
              _ev(4.5, "phase", attempt=0, phase="training", step=4),
              _ev(7.0, "crash", attempt=0, rank=0, fatal=True), _ev(7.5, "stopped", attempt=0),
              _ev(8.0, "start", attempt=1), _ev(9.0, "resumed", attempt=1, step=4, lost_steps=3),
              _ev(10.0, "first_step", attempt=1, step=5), _ev(12.0, "job_end")]
    r = goodput(events)
    assert r["badput_s"]["lost_progress"] == 2.5  # 4.5 .. 7.0
    assert r["badput_s"]["detection_recovery"] == 1.0  # 7.0 .. 8.0
    assert r["badput_s"]["startup_compile"] == 4.0  # 0..2 and 8..10
    assert r["badput_s"]["checkpoint_stall"] == 0.5 and r["productive_s"] == 2.0 + 2.0
    assert set(r["badput_s"]) == set(CATEGORIES)


def test_paint_gives_overlaps_to_the_higher_priority():
    totals = paint([(0, 10, "startup_compile"), (5, 8, "restore"), (7, 12, "detection_recovery")], 0, 20)
    assert totals["startup_compile"] == 5 and totals["restore"] == 2 and totals["detection_recovery"] == 5
    assert totals["productive"] == 8
