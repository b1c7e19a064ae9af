"""Real `angel-jax launch -n 2` jobs of the tiny GPT (gloo collectives between two CPU processes) for the watchdog's
fault tests (test_watchdog_faults.py: the crash and hang timings, run alone; test_watchdog_recovery.py: the
recoveries, run beside other tests): starting them, reading what they left, and the check that a recovered job
repeats ONE uninterrupted 2-worker launch of the same config (`reference`) bit for bit.

Every launcher runs under `timeout -s KILL` in its own session; its workers die with it (PR_SET_PDEATHSIG), and
any left at teardown are killed by pid. A test module takes the fixtures `launches` and `reference` by importing
them (each module gets its own: they are module-scoped).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
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

ROOT = Path(__file__).resolve().parent.parent
STEPS, EVERY = 16, 4
LIMIT = 240  # seconds: the `timeout -s KILL` guard of every launcher
EXACT_KEYS = ("loss", "grad_norm", "update_norm", "lr")
HANG_TIMEOUT = 6.0
# Every worker compiles without XLA's backend (LLVM) optimisations: about half the compile time of each start
# (rank 1 compiles all its programs at every start: JAX writes the persistent cache from process 0 only). The
# reference is compiled the same way; what is checked is the watchdog, and that a recovered job repeats the
# uninterrupted one bit for bit, which holds for any fixed compiler settings.
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
    """Starts launchers; at teardown kills what is left (launcher groups, then workers named in watchdog.json).
    `resilience` is the module's settings (RESILIENCE by default), a job's own on top."""

    def __init__(self, directory: Path, write_config, cache: Path, resilience: dict | None = None):
        self.directory, self.write_config, self.cache = directory, write_config, cache
        self.resilience = RESILIENCE if resilience is None else resilience
        self.jobs: list[Job] = []

    def start(self, name: str, *, env: dict[str, str] | None = None, resilience: dict | None = None,
              args: tuple[str, ...] = (), shared_cache: bool = True, memory: dict | None = None) -> Job:
        res = {**self.resilience, **(resilience or {})}
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


def launches_fixture(resilience: dict | None = None):
    """A module-scoped `launches` fixture whose jobs run with `resilience` (RESILIENCE by default)."""

    @pytest.fixture(scope="module")
    def launches(tmp_path_factory, write_tiny_config):
        root = tmp_path_factory.mktemp("watchdog")
        ls = Launches(root, write_tiny_config, root / "compile_cache", resilience)
        yield ls
        ls.close()

    return launches


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
    resumed from the newest checkpoint committed before it (`assert_resumed_from_newest`). Returns the watchdog's
    'resumed' events, one per restart."""
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
    assert_resumed_from_newest(job)
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


COMMITTED = ("snapshotted", "backed_up", "persisted")
"""The states of a save (its `checkpoint_state` events) in which a tier holds it committed: a restart may resume it."""


def newest_committed(job: Job) -> dict[int, int]:
    """Attempt -> the newest step committed, by every process that saves, before that attempt started (0: none),
    from the saves' `checkpoint_state` events (each written once its tier's commit is done) and the watchdog's
    'start' events, in the order the job appended them to events.jsonl."""
    events = job.events(source=None)
    committed: dict[str, set[int]] = {e["source"]: set() for e in events if e["kind"] == "checkpoint_state"}
    newest = {}
    for e in events:
        if e["kind"] == "checkpoint_state" and e["state"] in COMMITTED:
            committed[e["source"]].add(e["step"])
        elif e["kind"] == "start" and e["source"] == "watchdog":
            newest[e["attempt"]] = max(set.intersection(*committed.values()) if committed else set(), default=0)
    return newest


def assert_resumed_from_newest(job: Job) -> list[dict]:
    """Each restart resumed from the newest checkpoint committed before it, whatever the machine's load made that
    (a save still queued behind the previous one's persistence when the worker died is not committed, so the
    restart goes back two intervals or more, rightly), and from no older one. Or from the next save's step (a
    periodic one, or the step a stopped group agreed on), when a kill came between that save's commit and its
    event. Returns the watchdog's 'resumed' events."""
    newest, agreed = newest_committed(job), steps_saved_on_stop(job)
    resumed = job.events("resumed")
    for r in resumed:
        want = newest[r["attempt"]]
        after = min([(want // EVERY + 1) * EVERY, *(a for a in agreed if a > want)])
        assert r["step"] in (want, after), (r, want, after, agreed)
        assert r["lost_steps"] is not None and r["lost_steps"] >= 0, r
    return resumed


def steps_saved_on_stop(job: Job) -> set[int]:
    """The steps the job's groups saved when they were stopped (process 0's logs say so)."""
    return {int(m) for log in (job.run_dir / "logs").glob("attempt*-rank0.log")
            for m in re.findall(r"every process stops after step (\d+)", log.read_text(errors="replace"))}


def forge(job: Job) -> None:
    """Heartbeats from someone without the token, and garbage, sent to the running job's watchdog."""
    host, port = job.status()["heartbeat_addr"].rsplit(":", 1)
    forged = {"v": 1, "kind": "anomaly", "rank": 0, "attempt": 0, "seq": 10**6, "time": 0.0, "pid": 1, "node": "",
              "step": 1, "phase": "training", "detector": "hang", "action": "restart", "anomaly_step": 1,
              "anomaly_rank": 0, "message": "forged"}
    for data in (encode("not-the-token", forged), b"{garbage\n"):
        with socket.create_connection((host, int(port))) as s:
            s.sendall(data)
