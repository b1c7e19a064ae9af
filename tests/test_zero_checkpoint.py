"""Checkpoints of the sharded (ZeRO-3) paged engine, in one process with two CPU devices (zero_ckpt_check.py):
the same world size restores bit for bit; another world size reshards the pages from the persistent tier."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 240  # seconds: a hung collective must not hang the suite


@pytest.fixture(scope="module")
def checked() -> dict:
    run = subprocess.run(["timeout", "-s", "KILL", str(LIMIT), sys.executable,
                          str(Path(__file__).with_name("zero_ckpt_check.py"))], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    out["log"] = run.stderr
    return out


def test_same_world_size_is_bit_exact(checked):
    """Saved at step 3 over 2 ranks, restored (memory tier) over 2 ranks: every page, small leaf and counter equal
    the saved ones, and the remaining steps give the uninterrupted run's losses exactly."""
    same, uninterrupted = checked["same"], checked["losses"]["uninterrupted"]
    assert uninterrupted[-1] < uninterrupted[0]  # it trains
    assert (same["step"], same["tier"], same["ranks"]) == (3, "memory", 2)
    assert same["bit_exact"]
    assert same["losses"] == uninterrupted[3:]


def test_another_world_size_reshards(checked):
    """2 -> 1 -> 2 ranks from the persistent tier: each resumed run continues the uninterrupted run's losses (another
    reduction order: to float rounding), the state back on 2 ranks is the saved state bit for bit, and each
    resharding is logged."""
    uninterrupted = checked["losses"]["uninterrupted"]
    assert [(r["from"], r["to"], r["step"], r["tier"]) for r in checked["resumes"]] == \
        [(2, 1, 3, "persistent"), (1, 2, 3, "persistent")]
    for r in checked["resumes"]:
        np.testing.assert_allclose(r["losses"], uninterrupted[3:], rtol=1e-5, atol=0, err_msg=f"{r['from']} -> {r['to']}")
    assert checked["resumes"][1]["bit_exact_with_saved"]
    assert checked["streamed"]["1"] > 0  # the one-device run streams: resharded pages went to host as well as device
    for a, b in ((2, 1), (1, 2)):
        assert f"resharding the checkpoint's pages from {a} to {b} ranks" in checked["log"]


def test_another_layout_is_refused(checked):
    """A checkpoint whose pages are not this model's over its own ranks is refused, naming the difference, rather
    than resharded."""
    message = checked["other_layout"]
    assert "page layout differs" in message and "over the checkpoint's 2 ranks" in message and "'embed'" in message
