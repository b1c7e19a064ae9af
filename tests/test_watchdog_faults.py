"""Fault injection with real processes: `angel-jax launch -n 2` of the tiny GPT (gloo collectives between two
CPU processes), with a worker SIGKILLed, SIGSTOPped, raising, killed while writing a checkpoint, or crashing at
the same step every time.

Each recovered job must finish every step with the same per-step numbers (metrics.jsonl) and the same final
parameters (the final checkpoint, bit for bit) as ONE uninterrupted 2-worker launch of the same config
(`reference`), and recompute at most one checkpoint interval per restart. A launch costs ~15 s of start-up and
compilation, so two tests whose faults can follow one another in one job share its launch (a module fixture): one
fault per attempt, scoped by ANGEL_JAX_ATTEMPT. Every launcher runs under `timeout -s KILL` in its own session;
its workers die with it (PR_SET_PDEATHSIG), and any left at teardown are killed by pid.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from angel_jax.checkpoint import CheckpointManager, CheckpointOptions
from angel_jax.tee.events import read_events
from angel_jax.tol.heartbeat import encode
from angel_jax.train import metrics as M
from conftest import comparing_env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
STEPS, EVERY = 16, 4
LIMIT = 240  # seconds: the `timeout -s KILL` guard of every launcher
EXACT_KEYS = ("loss", "grad_norm", "update_norm", "lr")
HANG_TIMEOUT = 6.0
# Every worker of the module compiles without XLA's backend (LLVM) optimisations: about half the compile time of
# each start (rank 1 compiles all its programs at every start: JAX writes the persistent cache from process 0 only).
# The reference is compiled the same way; what is checked here is the watchdog, and that a recovered job repeats
# the uninterrupted one bit for bit, which holds for any fixed compiler settings.
XLA_FLAGS = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), "--xla_backend_optimization_level=0"]))
RESILIENCE = {"hang_timeout_min": HANG_TIMEOUT, "slow_phase_timeout": 120.0, "stop_grace": 3.0,
              "heartbeat_interval": 0.5, "heartbeat_lost_after": 2.0, "max_restarts": 3}


@dataclass
class Job:
    name: str
    run_dir: Path
    memory_dir: Path
    proc: subprocess.Popen
    out_path: Path
    started: float

    @property
    def out(self) -> str:
        return self.out_path.read_text()

    def events(self, kind: str | None = None, source: str | None = "watchdog") -> list[dict]:
        return [e for e in read_events(self.run_dir / "events.jsonl", kind) if source is None or e["source"] == source]

    def status(self) -> dict:
        try:
            return json.loads((self.run_dir / "watchdog.json").read_text())
        except (OSError, json.JSONDecodeError):
            return {}

    def step(self, since: float = 0.0) -> int:
        """The newest step in metrics.jsonl (process 0 writes one line per step) among the lines written after
        `since` (a wall-clock time)."""
        try:
            lines = (self.run_dir / "metrics.jsonl").read_text().splitlines()
        except OSError:
            return 0
        records = [json.loads(line) for line in lines if line.endswith("}")]
        return max((r["step"] for r in records if r["time"] > since), default=0)

    def wait(self, timeout: float = LIMIT) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.name}: the launcher did not finish in {timeout} s:\n{self.out[-4000:]}")

    def wait_for(self, predicate, what: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert self.proc.poll() is None, f"{self.name} ended before {what}:\n{self.out[-4000:]}"
            assert time.monotonic() < deadline, f"{self.name}: no {what} within {timeout} s:\n{self.out[-4000:]}"
            time.sleep(0.005)

    def worker_pid(self, rank: int) -> int:
        return self.status()["workers"][rank]["pid"]


class Launches:
    """Starts launchers; at teardown kills what is left (launcher groups, then workers named in watchdog.json)."""

    def __init__(self, directory: Path, write_config, cache: Path):
        self.directory, self.write_config, self.cache = directory, write_config, cache
        self.jobs: list[Job] = []

    def start(self, name: str, *, env: dict[str, str] | None = None, resilience: dict | None = None,
              args: tuple[str, ...] = (), shared_cache: bool = True, memory: dict | None = None) -> Job:
        res = {**RESILIENCE, **(resilience or {})}
        if shared_cache:  # one cold compilation for the whole module; the compile-cache test uses its run dir
            res["compile_cache_dir"] = str(self.cache)
        cfg = self.write_config(self.directory, name, train={"steps": STEPS},
                                checkpoint={"every": EVERY, "keep": 2}, resilience=res, memory=memory or {})
        out_path = self.directory / f"{name}.out"
        cmd = ["timeout", "-s", "KILL", str(LIMIT), sys.executable, "-m", "angel_jax.cli", "launch", "-n", "2",
               *args, str(cfg)]
        # Every launch at full fp32 matmul precision: the reference is compared bit for bit with recovered jobs of
        # the same program, and to float rounding with the paged engine's.
        child_env = comparing_env(dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=XLA_FLAGS, **(env or {})))
        child_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), child_env.get("PYTHONPATH")) if p)
        with open(out_path, "w") as out:
            proc = subprocess.Popen(cmd, cwd=self.directory, env=child_env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        job = Job(name, self.directory / name, Path(str(self.directory / name) + ".memtier"), proc, out_path,
                  time.time())
        self.jobs.append(job)
        return job

    def close(self) -> None:
        for job in self.jobs:
            if job.proc.poll() is None:
                os.killpg(job.proc.pid, signal.SIGKILL)
                job.proc.wait(timeout=30)
            for w in job.status().get("workers", []):
                _kill_if_worker(w.get("pid"), job.run_dir)


def _kill_if_worker(pid: int | None, run_dir: Path) -> None:
    """SIGKILL `pid` only if it is still one of this job's workers (its command line names the job's config)."""
    if not pid:
        return
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return
    if "angel_jax.tol.worker" in cmdline and run_dir.name in cmdline:
        os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def launches(tmp_path_factory, write_tiny_config):
    root = tmp_path_factory.mktemp("watchdog")
    ls = Launches(root, write_tiny_config, root / "compile_cache")
    yield ls
    ls.close()


@dataclass
class Reference:
    records: list[dict]
    arrays: dict[str, np.ndarray]


def _final_arrays(job: Job, step: int = STEPS) -> dict[str, np.ndarray]:
    engine = CheckpointManager(CheckpointOptions(persistent_dir=job.run_dir / "checkpoints", memory_dir=job.memory_dir))
    try:
        return dict(engine.restore(step).arrays)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def reference(launches) -> Reference:
    """One uninterrupted 2-worker launch of the same config."""
    job = launches.start("reference")
    assert job.wait() == 0, job.out[-4000:]
    assert not job.events("restart") and job.events("job_end")[0]["state"] == "succeeded"
    records = M.read_jsonl(job.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return Reference(records, _final_arrays(job))


def assert_same_as_reference(job: Job, ref: Reference, restarts: int = 1) -> list[dict]:
    """The job finished every step with the reference's numbers and final state after `restarts` restarts, each
    recomputing at most one checkpoint interval. Returns the watchdog's 'resumed' events, one per restart."""
    rc = job.wait()
    assert rc == 0, job.out[-5000:]
    (end,) = job.events("job_end")
    assert end["state"] == "succeeded" and end["restarts"] == restarts, end
    records = M.read_jsonl(job.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), "one line per step after the restarts"
    for r, want in zip(records, ref.records):
        assert [r[k] for k in EXACT_KEYS] == [want[k] for k in EXACT_KEYS], f"step {r['step']}"
    arrays = _final_arrays(job)
    assert arrays.keys() == ref.arrays.keys()
    for key in arrays:
        assert np.array_equal(arrays[key], ref.arrays[key]), key
    resumed = job.events("resumed")
    assert len(resumed) == restarts, resumed
    agreed = _steps_saved_on_stop(job)
    for r in resumed:
        # A periodic checkpoint, or the step the whole group agreed on and saved when the watchdog stopped it (a
        # hung worker that SIGCONT woke up takes part in the agreement).
        assert (r["step"] % EVERY == 0 or r["step"] in agreed) and 0 <= r["lost_steps"] <= EVERY, (r, agreed)
    # the steps after the last resumed checkpoint were logged again, by the last attempt
    restart_events = job.events("restart")
    assert len(restart_events) == restarts, restart_events
    later = [r["step"] for r in records if r["time"] > restart_events[-1]["time"]]
    assert later == list(range(resumed[-1]["step"] + 1, STEPS + 1))
    recovered = job.events("recovered")
    assert [(e["attempt"], e["step"]) for e in recovered] == [(k + 1, r["step"] + 1) for k, r in enumerate(resumed)]
    goodput = json.loads((job.run_dir / "goodput.json").read_text())
    assert goodput["restarts"] == restarts and goodput["lost_steps"] == sum(r["lost_steps"] for r in resumed)
    assert goodput["productive_s"] + sum(goodput["badput_s"].values()) == pytest.approx(goodput["wall_s"], abs=0.01)
    return resumed


def _steps_saved_on_stop(job: Job) -> set[int]:
    """The steps the job's groups saved when they were stopped (process 0's logs say so)."""
    import re

    return {int(m) for log in (job.run_dir / "logs").glob("attempt*-rank0.log")
            for m in re.findall(r"every process stops after step (\d+)", log.read_text(errors="replace"))}


def _forge(job: Job) -> None:
    """Heartbeats from someone without the token, and garbage, sent to the running job's watchdog."""
    import socket

    host, port = job.status()["heartbeat_addr"].rsplit(":", 1)
    forged = {"v": 1, "kind": "anomaly", "rank": 0, "attempt": 0, "seq": 10**6, "time": 0.0, "pid": 1, "node": "",
              "step": 1, "phase": "training", "detector": "hang", "action": "restart", "anomaly_step": 1,
              "anomaly_rank": 0, "message": "forged"}
    for data in (encode("not-the-token", forged), b"{garbage\n"):
        with socket.create_connection((host, int(port))) as s:
            s.sendall(data)


# --------------------------------------------------------------------------------------------- the faults


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
    _forge(job)
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


@pytest.fixture(scope="module")
def rank0_killed(launches) -> tuple[Job, int]:
    """One launch for two tests: process 0 is SIGKILLed from outside in attempt 0 (after step 5), then by the
    checkpoint manager's kill point while it copies step 12's snapshot into the memory tier in attempt 1. The job
    keeps its compilation cache in its run directory (the default), not in the module's shared one. Returns the
    job and the pid killed first."""
    job = launches.start("rank0", shared_cache=False, env={"ANGEL_JAX_CKPT_KILL_AT": "snapshot.copy@12:attempt=1"})
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
    attempt after the one killed above): step 8 is the newest valid checkpoint. (The in-memory engine's saves hold
    the immutable state and copy it in the background, so the loop has already left the 'checkpointing' phase when
    the copy dies.)"""
    job, _ = rank0_killed
    resumed = assert_same_as_reference(job, reference, restarts=2)
    crash = job.events("crash")[1]
    assert (crash["rank"], crash["status"], crash["step"], crash["attempt"]) == (0, "was killed by SIGKILL", 12, 1)
    assert (resumed[1]["step"], resumed[1]["lost_steps"]) == (8, 4)
    # the loop's own record agrees
    assert [e["step"] for e in job.events("resumed", source="rank0")] == [r["step"] for r in resumed]


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
    (resumed,) = job.events("resumed")
    assert resumed["step"] % EVERY == 0 and 0 < resumed["step"] <= 5, resumed
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
    """One launch for two tests: rank 1 raises at step 7 in attempt 0 and at step 10 in attempt 1 (both resume
    from step 8: step 8 is dispatched and checkpointed before on_step(7) runs), so its node, local1, has failed
    twice and attempt 2 runs on the spare."""
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
                                resilience={**RESILIENCE, "compile_cache_dir": str(launches.cache)})
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
    agreed = _steps_saved_on_stop(job)
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
