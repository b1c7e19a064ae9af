"""The watchdog's recoveries with real processes: `angel-jax launch -n 2` of the tiny GPT (gloo collectives between
two CPU processes, tests/watchdog_jobs.py), with process 0 SIGKILLed from outside and then while it writes a
checkpoint, a worker of a sharded paged job SIGKILLed, a worker that crashes at the same step every time, a node
that fails twice and is replaced by a spare, the worker started as Slurm would start it, and SIGTERM to the launcher.

Each recovered job must finish every step with the same per-step numbers (metrics.jsonl) and the same final
parameters (the final checkpoint, bit for bit) as ONE uninterrupted 2-worker launch of the same config
(`reference`), and resume each restart from the newest checkpoint committed before it: which one that is
depends on the machine's load (a save waits behind the previous one's persistence), so it is read from the saves'
own `checkpoint_state` events, not assumed to be one interval back. A launch costs ~15 s of start-up and
compilation, so two tests whose faults can follow one another in one job share its launch (a module fixture): one
fault per attempt, scoped by ANGEL_JAX_ATTEMPT.

No assertion here holds a wall-clock bound (those of the crash and hang detection are test_watchdog_faults.py's,
run alone), so the module runs beside the other tests: with a hang timeout of 20 s, as under Slurm
(test_slurm.py), since none of these jobs hangs on purpose and a loaded machine's slow step must not pass for one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from angel_jax.train import metrics as M
from watchdog_jobs import (EVERY, EXACT_KEYS, LIMIT, RESILIENCE, ROOT, STEPS, XLA_FLAGS, Job,  # noqa: F401
                           assert_resumed_from_newest, assert_same_as_reference, launches_fixture, newest_committed,
                           reference, steps_saved_on_stop)

pytestmark = pytest.mark.slow

launches = launches_fixture({**RESILIENCE, "hang_timeout_min": 20.0})


@pytest.fixture(scope="module")
def rank0_killed(launches) -> tuple[Job, int]:
    """One launch for two tests: process 0 is SIGKILLed from outside in attempt 0 (after step 5), then by the
    checkpoint manager's kill point while it copies step 12's snapshot into the memory tier in attempt 1. The job
    keeps its compilation cache in its run directory (the default), not in the module's shared one. Returns the
    job and the pid killed first.

    After step 5 (the one waited for: its line in metrics.jsonl comes after the hooks of its step) attempt 0's steps
    are slowed eightfold (a sleep: the numbers stay the same), so that the kill surely comes before step 12 is
    committed (after which attempt 1 would never save step 12) however late a busy machine lets this process see
    step 5; a kill that comes at once lands in step 6's sleep and costs nothing."""
    job = launches.start("rank0", shared_cache=False, env={"ANGEL_JAX_CKPT_KILL_AT": "snapshot.copy@12:attempt=1",
                                                           "ANGEL_JAX_FAULTS": "slow@6:factor=8:attempt=0"})
    job.wait_for(lambda: job.step() >= 5, "step 5")
    pid = job.worker_pid(0)
    os.kill(pid, signal.SIGKILL)
    job.wait()
    return job, pid


def test_sigkill_of_process_0_and_the_compile_cache(rank0_killed, reference):
    """Process 0 serves JAX's coordination service and writes the checkpoints. This job keeps its compilation
    cache in its run directory (the default): every restarted process 0 loads its programs from it."""
    job, pid = rank0_killed
    assert_same_as_reference(job, reference, restarts=2)
    crash = job.events("crash")[0]
    assert (crash["rank"], crash["status"], crash["pid"], crash["attempt"]) == (0, "was killed by SIGKILL", pid, 0)
    assert any((job.run_dir / "compile_cache").iterdir())
    first, *restarted = job.events("first_step")
    assert len(restarted) == 2
    cold = first["compile_cache"]["0"]
    assert cold["requests"] > 0 and cold["hits"] == 0
    for e in restarted:
        warm = e["compile_cache"]["0"]
        assert warm["requests"] > 0 and warm["hits"] == warm["requests"], e


def test_crash_while_a_checkpoint_is_written(rank0_killed, reference):
    """Process 0 dies by SIGKILL in the middle of copying step 12's snapshot into the memory tier (in the
    attempt after the one killed above): step 8 is the newest valid checkpoint (one worker takes the saves in
    order: step 8's commit comes before step 12's copy). The in-memory engine's saves hold the immutable state and
    copy it in the background, so the loop has already left the 'checkpointing' phase when the copy dies, and on
    a busy machine, with step 8 still persisting, the loop is steps further on: at least step 12."""
    job, _ = rank0_killed
    resumed = assert_same_as_reference(job, reference, restarts=2)
    crash = job.events("crash")[1]
    assert (crash["rank"], crash["status"], crash["attempt"]) == (0, "was killed by SIGKILL", 1)
    assert 12 <= crash["step"] <= STEPS, crash
    assert newest_committed(job)[2] == 8  # step 12's save died in its copy, never committed
    assert resumed[1]["step"] == 8 and resumed[1]["lost_steps"] >= crash["step"] - 8, (resumed[1], crash)
    # the loop's own record agrees (it records a resume only from a checkpoint: on a busy machine step 4's may not
    # be committed when attempt 0 is killed, and attempt 1 then starts afresh, from step 0)
    assert [e["step"] for e in job.events("resumed", source="rank0")] == [r["step"] for r in resumed if r["step"]]


@pytest.mark.compares_programs
def test_sigkill_of_a_worker_with_sharded_paged_state(launches, reference):
    """The sharded paged engine under the watchdog: every page family split over the two processes (ZeRO-3),
    blocks streamed through host memory. Rank 1 is SIGKILLed after step 5; the job resumes from its last checkpoint
    and ends with the numbers of the uninterrupted in-memory launch (`reference`), within the float tolerance the
    two engines agree to (their arithmetic differs: pages, gathers, reduce-scatters)."""
    job = launches.start("paged", memory={"mode": "paged", "page_size": 16384, "device_budget": 470_000})
    job.wait_for(lambda: job.step() >= 5, "step 5")
    os.kill(job.worker_pid(1), signal.SIGKILL)
    assert job.wait() == 0, job.out[-5000:]
    (end,) = job.events("job_end")
    assert end["state"] == "succeeded" and end["restarts"] == 1, end
    (crash,) = job.events("crash")
    assert (crash["rank"], crash["status"]) == (1, "was killed by SIGKILL")
    # Every process writes its own shards: the newest step committed by both (a restart on a busy machine may go
    # back two intervals)
    (resumed,) = assert_resumed_from_newest(job)
    assert resumed["step"] % EVERY == 0, resumed
    assert json.loads((job.run_dir / "plan.json").read_text())["streamed"] > 0  # blocks streamed, not resident
    for attempt in (0, 1):  # every page split over the two processes, in both attempts
        assert "each of 2 devices (every page sharded over them: ZeRO-3" in \
            (job.run_dir / "logs" / f"attempt{attempt}-rank0.log").read_text()
    records = M.read_jsonl(job.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r, want in zip(records, reference.records):
        for key in ("loss", "grad_norm"):
            assert r[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (r["step"], key)


def test_a_worker_that_crashes_every_time_ends_in_failed(launches):
    # raise@6, not @7: metrics are read a step late, so step 8 is dispatched (and checkpointed by process 0)
    # before on_step(7) runs; a fault at 7 would be behind the restored checkpoint of step 8 and never rerun.
    # A budget of one restart: the restarted attempt crashes too and the budget is spent (that restarts add up
    # over several failed attempts is test_tol_coordinator's, with real processes the spare test's two restarts).
    job = launches.start("always", env={"ANGEL_JAX_FAULTS": "raise@6:rank=1"},
                         resilience={"max_restarts": 1, "no_progress_limit": 0})
    assert job.wait() == 1, job.out[-4000:]
    (end,) = job.events("job_end")
    assert end["state"] == "failed" and end["restarts"] == 1 and end["attempts"] == 2
    assert end["summary"].startswith("job failed after 1 restart(s): the restart budget is spent "
                                     "(resilience.max_restarts=1). Last failure: rank 1 (node local1, pid ")
    assert "exited with status 1 at step 6 in phase training: InjectedFault: injected fault: raise@6" in end["summary"]
    assert len(job.events("crash")) == 2 and len(job.events("start")) == 2
    assert "job failed after 1 restart(s)" in job.out.splitlines()[-1]


@pytest.fixture(scope="module")
def node_fails_twice(launches) -> Job:
    """One launch for two tests: rank 1 raises at step 7 in attempt 0 and at step 10 in attempt 1, so its node,
    local1, has failed twice and attempt 2 runs on the spare. Each restart resumes from the newest checkpoint
    committed before it: step 8 (dispatched before on_step(7) runs, and checkpointed by process 0) when its commit
    beat the group's teardown, else step 4."""
    job = launches.start("exclude", env={"ANGEL_JAX_FAULTS": "raise@7:rank=1:attempt=0,raise@10:rank=1:attempt=1"},
                         resilience={"exclude_after": 2}, args=("--spares", "1"))
    job.wait()
    return job


def test_exception_in_a_worker_at_a_chosen_step(node_fails_twice, reference):
    job = node_fails_twice
    assert_same_as_reference(job, reference, restarts=2)
    crashes = job.events("crash")
    assert [(c["rank"], c["returncode"], c["step"], c["attempt"]) for c in crashes] == [(1, 1, 7, 0), (1, 1, 10, 1)]
    for crash in crashes:
        assert crash["message"].endswith(f"exited with status 1 at step {crash['step']} in phase training: "
                                         f"InjectedFault: injected fault: raise@{crash['step']}")


def test_a_node_that_fails_twice_is_replaced_by_a_spare(node_fails_twice, reference):
    job = node_fails_twice
    assert job.wait() == 0, job.out[-4000:]
    (exclusion,) = job.events("exclusion")
    assert (exclusion["node"], exclusion["replaced_by"], exclusion["failures"]) == ("local1", "local2", 2)
    last_start = job.events("start")[-1]
    assert [w["node"] for w in last_start["workers"]] == ["local0", "local2"]
    records = M.read_jsonl(job.run_dir / "metrics.jsonl")
    assert [[r[k] for k in EXACT_KEYS] for r in records] == [[r[k] for k in EXACT_KEYS] for r in reference.records]


def test_the_worker_under_slurm_without_the_launcher(launches, reference, tmp_path):
    """`angel-jax worker` as `srun -n 2` would start it: only Slurm's variables (no ANGEL_JAX_COORDINATOR_*), so
    jax.distributed.initialize() finds the job by itself; heartbeats still go to a server when the address and
    token are given. Same config, same numbers as the launched reference."""
    import random
    import socket

    from angel_jax.tol.heartbeat import HeartbeatServer

    while True:  # JAX's Slurm support derives the coordinator port from the job id
        job_id = random.randrange(10**5, 10**6)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", job_id % 4096 + 61440))
                break
            except OSError:
                continue
    cfg = launches.write_config(launches.directory, "slurm", train={"steps": STEPS},
                                checkpoint={"every": EVERY, "keep": 2},
                                resilience={**launches.resilience, "compile_cache_dir": str(launches.cache)})
    server = HeartbeatServer("slurm-token", 2).start()
    procs = []
    try:
        for rank in range(2):
            env = {k: v for k, v in os.environ.items() if not k.startswith("ANGEL_JAX_")}
            env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=XLA_FLAGS, PYTHONPATH=str(ROOT), SLURM_JOB_ID=str(job_id),
                       SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2", SLURM_PROCID=str(rank),
                       SLURM_LOCALID=str(rank), ANGEL_JAX_HEARTBEAT_ADDR=server.address,
                       ANGEL_JAX_JOB_TOKEN="slurm-token")
            with open(tmp_path / f"rank{rank}.log", "w") as log:
                procs.append(subprocess.Popen(
                    ["timeout", "-s", "KILL", str(LIMIT), sys.executable, "-m", "angel_jax.cli", "worker", str(cfg)],
                    cwd=launches.directory, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        codes = [p.wait(timeout=LIMIT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        server.close()
    logs = [(tmp_path / f"rank{r}.log").read_text() for r in range(2)]
    assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert "worker 1 of 2" in logs[1]
    records = M.read_jsonl(launches.directory / "slurm" / "metrics.jsonl")
    assert [[r[k] for k in EXACT_KEYS] for r in records] == [[r[k] for k in EXACT_KEYS] for r in reference.records]
    bodies = []
    while not server.inbox.empty():
        item = server.inbox.get()
        assert item[0] == "message", item
        bodies.append(item[2])
    assert {b["rank"] for b in bodies} == {0, 1}
    assert [b["code"] for b in bodies if b["kind"] == "exit"] == [0, 0]
    assert max(b["step"] for b in bodies) == STEPS


def test_sigterm_to_the_watchdog_saves_a_step_both_workers_agree_on(launches, reference):
    """A preemption of the whole job: SIGTERM to the launcher (as Slurm or Kubernetes send it) mid-run. The workers
    agree on a step through jax's preemption service, both finish it and it is saved (unless a periodic save just
    did), the launcher exits 143; a relaunch resumes from that step and ends with the uninterrupted launch's
    numbers. From step 4 on, the steps are slowed eightfold (a sleep: the numbers stay the same) so that the signal
    surely comes before the last one: the tiny model's steps take ~30 ms, the whole job after step 5 under a
    second."""
    job = launches.start("preempted", env={"ANGEL_JAX_FAULTS": "slow@4:factor=8"})
    job.wait_for(lambda: job.step() >= 5, "step 5")
    job.proc.send_signal(signal.SIGTERM)  # `timeout` passes it on to the launcher
    assert job.wait() == 143, job.out[-5000:]
    (end,) = job.events("job_end")
    assert end["state"] == "interrupted", end
    assert all("status 143" in outcome for outcome in end["outcomes"].values()), end
    agreed = steps_saved_on_stop(job)
    assert len(agreed) == 1, (agreed, job.out[-3000:])
    (step,) = agreed
    for rank in (0, 1):
        log = (job.run_dir / "logs" / f"attempt0-rank{rank}.log").read_text()
        assert f"every process stops after step {step}" in log, log[-3000:]
    saved = sorted(int(p.name) for p in (job.run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert 5 <= step < STEPS and saved[-1] == step, (step, saved)

    again = launches.start("preempted")
    assert again.wait() == 0, again.out[-4000:]
    assert [e["step"] for e in again.events("resumed", source="rank0")][-1:] == [step]
    records = M.read_jsonl(again.run_dir / "metrics.jsonl")
    by_step = {r["step"]: r for r in records}  # the relaunch's lines of steps after the save replace none
    assert sorted(by_step) == list(range(1, STEPS + 1))
    for want in reference.records:
        assert [by_step[want["step"]][k] for k in EXACT_KEYS] == [want[k] for k in EXACT_KEYS], want["step"]
