"""The watchdog's crash and hang timings with real processes: `angel-jax launch -n 2` of the tiny GPT (gloo
collectives between two CPU processes, tests/watchdog_jobs.py), with a worker SIGKILLed, then SIGSTOPped.

The job must notice the crash within 2 s and the hang within its timeout +- 2 s, and still finish every step with
the same per-step numbers (metrics.jsonl) and the same final parameters (the final checkpoint, bit for bit) as ONE
uninterrupted 2-worker launch of the same config (`reference`), each restart resumed from the newest checkpoint
committed before it. The detection bounds are wall-clock ones: the module runs alone (conftest.SERIAL_MODULES).
The recoveries that hold no such bound (process 0 killed, a crash in a checkpoint write, sharded paged state, a
crash every time, a node replaced by a spare, the worker under Slurm's variables, SIGTERM to the launcher) are
test_watchdog_recovery.py, which runs beside the other tests.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import pytest

from watchdog_jobs import HANG_TIMEOUT, Job, assert_same_as_reference, forge, launches_fixture, reference  # noqa: F401

pytestmark = pytest.mark.slow

launches = launches_fixture()


@dataclass
class Rank1Faults:
    job: Job
    killed_at: float
    stopped_pid: int
    stopped_at: float


@pytest.fixture(scope="module")
def rank1_faults(launches) -> Rank1Faults:
    """One launch for two tests: rank 1 is SIGKILLed in attempt 0 (after step 5, with forged heartbeats sent just
    before), and SIGSTOPped in attempt 1 (once attempt 1 has logged step 9: in training, past the checkpoint it
    resumed from).

    hang_factor 3: the hang timeout is HANG_TIMEOUT unless the p95 step time passes HANG_TIMEOUT / 3 (the second
    step, which runs a program the first did not, takes ~1 s on a 2-core machine: with the default factor of 10
    it set the timeout to ~11 s, close to the bound test_sigstop_of_a_worker_is_a_hang checks, and the test
    waited for it)."""
    job = launches.start("rank1", resilience={"hang_factor": 3.0})
    job.wait_for(lambda: job.step() >= 5, "step 5")
    forge(job)
    os.kill(job.worker_pid(1), signal.SIGKILL)
    killed_at = time.time()
    job.wait_for(lambda: job.events("restart"), "the restart")
    (restart,) = job.events("restart")
    job.wait_for(lambda: job.step(since=restart["time"]) >= 9, "step 9 in attempt 1")
    pid = job.worker_pid(1)
    os.kill(pid, signal.SIGSTOP)
    stopped_at = time.time()
    job.wait()
    return Rank1Faults(job, killed_at, pid, stopped_at)


def test_sigkill_of_a_worker_mid_run(rank1_faults, reference):
    job = rank1_faults.job
    assert_same_as_reference(job, reference, restarts=2)
    (crash,) = job.events("crash")
    assert (crash["rank"], crash["status"], crash["returncode"], crash["attempt"]) == (1, "was killed by SIGKILL",
                                                                                      -9, 0)
    assert crash["time"] - rank1_faults.killed_at <= 2.0, "a crash is noticed within 2 s"
    rejected = job.events("heartbeat_rejected")
    assert sorted(e["reason"].split(":")[0] for e in rejected) == ["malformed", "unauthenticated"]
    assert not job.events("anomaly"), "the forged anomaly changed nothing"


def test_sigstop_of_a_worker_is_a_hang(rank1_faults, reference):
    job, pid, stopped_at = rank1_faults.job, rank1_faults.stopped_pid, rank1_faults.stopped_at
    assert_same_as_reference(job, reference, restarts=2)
    (hang,) = job.events("hang")
    assert hang["rank"] == 1 and hang["attempt"] == 1 and hang["heartbeat_lost"] is True
    assert f"pid {pid})" in hang["message"]
    # The timeout is max(hang_timeout_min, hang_factor x p95 step time): on a loaded machine the steps' share wins.
    timeout = hang["timeout_s"]
    assert HANG_TIMEOUT <= timeout <= 2 * HANG_TIMEOUT
    assert hang["time"] - stopped_at <= timeout + 2.0, "a hang is noticed within its timeout + 2 s"
    assert hang["time"] - stopped_at >= timeout - 2.0, "not before the timeout (its last step came before)"
    assert any(e["rank"] == 1 and e["time"] > stopped_at for e in job.events("heartbeat_lost"))
