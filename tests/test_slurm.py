"""The watchdog across nodes, under a real Slurm: slurmctld and three `slurmd -N nK` on this machine
(scripts/slurm_cluster.sh), `angel-jax launch` inside an `salloc` allocation, each attempt's ranks as job steps.

Every job trains the tiny GPT with its state sharded over its two ranks (mesh.fsdp 2: each process checkpoints
its own shards), each node with a memory tier of its own (checkpoint.memory_dir .../{node}), and every snapshot
copied to the next node's memory over the network (checkpoint.peer_network, auto under Slurm). The budget and the
node-loss jobs must agree step for step: each resumed other steps (4 twice, 8) on other nodes from other tiers, so
every step computed after a restore in one was computed without it in the other.

  budget     rank 1 raises on n2 at step 7 in every attempt: one restart on the same nodes, a second failure of n2
             excludes it (resilience.exclude_after 2), the spare n3 takes its place, and rank 1 restores its shards
             there from the copy its neighbour n1 holds
  node loss  everything of n2 is killed mid-run (its slurmd, its slurmstepd, its worker, its memory: a machine gone);
             rank 0's collective breaks first, the node probe finds n2's daemon silent, the failure is charged to
             n2, which is excluded at once and replaced by n3, where rank 1 restores from n1's copy
  orphans    the launcher is SIGKILLed while the allocation lives on: no worker may survive it

Where no cluster can be had (not root, no package, a daemon that does not start) the tests skip with the reason,
except under CI, where they must run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from angel_jax.tee.events import read_events
from angel_jax.train import metrics as M
from conftest import comparing_env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
STEPS, EVERY = 16, 4
LIMIT = 300
EXACT_KEYS = ("loss", "grad_norm", "update_norm", "lr")
XLA_FLAGS = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), "--xla_backend_optimization_level=0"]))
RESILIENCE = {"hang_timeout_min": 20.0, "slow_phase_timeout": 120.0, "stop_grace": 3.0, "heartbeat_interval": 0.5,
              "heartbeat_lost_after": 4.0, "max_restarts": 3, "exclude_after": 2}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> dict[str, str]:
    """A 3-node cluster; yields the environment that reaches it (SLURM_CONF)."""
    where = tmp_path_factory.mktemp("slurm")
    done = subprocess.run(["timeout", "-s", "KILL", "300", "bash", str(ROOT / "scripts" / "slurm_cluster.sh"),
                           "start", str(where), "3"], capture_output=True, text=True)
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        if os.environ.get("CI"):
            pytest.fail(f"no Slurm cluster in CI: {why}")
        pytest.skip(f"no Slurm cluster here: {why}")
    env = dict(os.environ, SLURM_CONF=str(where / "slurm.conf"))
    yield env
    subprocess.run(["bash", str(ROOT / "scripts" / "slurm_cluster.sh"), "stop", str(where)], timeout=60)


class Job:
    def __init__(self, name: str, run_dir: Path, proc: subprocess.Popen, out: Path, memory: Path):
        self.name, self.run_dir, self.proc, self.out_path, self.memory = name, run_dir, proc, out, memory

    @property
    def out(self) -> str:
        return self.out_path.read_text(errors="replace")

    def events(self, kind: str | None = None, source: str = "watchdog") -> list[dict]:
        return [e for e in read_events(self.run_dir / "events.jsonl", kind) if e["source"] == source]

    def peer_copies(self, node: str, process: int) -> list[int]:
        """The steps of `process`'s shards whose copy `node` holds in its peer store."""
        return sorted(int(p.name[5:]) for p in (self.memory / f"{node}.peer").glob(f"*/process_{process}/step_*")
                      if p.name[5:].isdigit())

    def step(self) -> int:
        try:
            lines = (self.run_dir / "metrics.jsonl").read_text().splitlines()
        except OSError:
            return 0
        return max((json.loads(line)["step"] for line in lines if line.endswith("}")), default=0)

    def wait(self, timeout: float = LIMIT) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.name}: the job did not finish in {timeout} s:\n{self.out[-4000:]}")

    def wait_for(self, predicate, what: str, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert self.proc.poll() is None, f"{self.name} ended before {what}:\n{self.out[-4000:]}"
            assert time.monotonic() < deadline, f"{self.name}: no {what} within {timeout} s:\n{self.out[-4000:]}"
            time.sleep(0.02)


@pytest.fixture(scope="module")
def jobs(cluster, tmp_path_factory, write_tiny_config):
    root = tmp_path_factory.mktemp("slurm-jobs")
    started: list[Job] = []

    def start(name: str, *, faults: str = "", then: str = "", steps: int = STEPS) -> Job:
        memory = root / "memory" / name  # <node>/ and <node>.peer/ under it: each node's RAM, on one machine
        cfg = write_tiny_config(root, name, train={"steps": steps}, mesh={"fsdp": 2},
                                checkpoint={"every": EVERY, "keep": 2, "memory_dir": f"{memory}/{{node}}",
                                            "peer_timeout": 10.0},
                                resilience={**RESILIENCE, "compile_cache_dir": str(root / "cache")})
        launch = [sys.executable, "-m", "angel_jax.cli", "launch", "-n", "2", str(cfg)]
        # --no-kill: the allocation outlives a node that fails (the watchdog replaces it with the spare)
        command = ["bash", "-c", " ".join(launch) + (f"; {then}" if then else "")]
        env = comparing_env(dict(cluster, JAX_PLATFORMS="cpu", XLA_FLAGS=XLA_FLAGS))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        if faults:
            env["ANGEL_JAX_FAULTS"] = faults
        out = root / f"{name}.out"
        with open(out, "w") as f:
            proc = subprocess.Popen(["timeout", "-s", "KILL", str(LIMIT), "salloc", "-N", "3", "--no-kill", "-Q",
                                     f"--job-name={name}", *command], cwd=root, env=env, stdout=f,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        job = Job(name, root / name, proc, out, memory)
        started.append(job)
        return job

    yield start
    for pid in _processes_of(root, "angel_jax.cli"):  # launchers: salloc runs them in a session of their own
        os.kill(pid, signal.SIGKILL)
    for job in started:
        if job.proc.poll() is None:
            os.killpg(job.proc.pid, signal.SIGKILL)
            job.proc.wait(timeout=30)
    for pid in _workers_of(root) + _processes_of(root, "angel_jax.tol.worker", srun=True):
        os.kill(pid, signal.SIGKILL)


def _processes_of(root: Path, module: str, srun: bool = False) -> list[int]:
    """Live Python processes running `module` with an argument under `root` (or, with `srun`, the srun processes
    that started them)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if (Path(argv[0]).name == "srun") == srun and module in argv and any(str(root) in a for a in argv):
            pids.append(int(proc.name))
    return pids


def _workers_of(root: Path) -> list[int]:
    return _processes_of(root, "angel_jax.tol.worker")


def _kill_node(cluster: dict[str, str], node: str, memory: Path) -> None:
    """Everything of `node` dies at once, as when its machine goes: its slurmd, the slurmstepd of its job steps
    and their tasks (`slurm_cluster.sh kill-node`), and its RAM (its memory tier and peer store, under `memory`)."""
    _cluster_script(cluster, "kill-node", node)
    for tier in (memory / node, memory / f"{node}.peer"):
        shutil.rmtree(tier, ignore_errors=True)


def _revive(cluster: dict[str, str], node: str) -> None:
    _cluster_script(cluster, "revive", node)


def _cluster_script(cluster: dict[str, str], command: str, node: str) -> None:
    subprocess.run(["bash", str(ROOT / "scripts" / "slurm_cluster.sh"), command,
                    str(Path(cluster["SLURM_CONF"]).parent), node], check=True, timeout=60, env=cluster)


@pytest.fixture(scope="module")
def budget(jobs) -> Job:
    """The budget job, finished: the node-loss test compares its numbers with this job's."""
    job = jobs("budget", faults="raise@7:node=n2")
    assert job.wait() == 0, job.out[-5000:]
    return job


def assert_same_numbers(job: Job, other: Job) -> None:
    """Step for step, the numbers of two jobs that restored other steps on other nodes from other tiers: each step
    computed after a restore in one was computed without that restore in the other."""
    records, want = (M.read_jsonl(j.run_dir / "metrics.jsonl") for j in (job, other))
    assert [r["step"] for r in records] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    for r, w in zip(records, want):
        assert [r[k] for k in EXACT_KEYS] == [w[k] for k in EXACT_KEYS], f"step {r['step']}"


def assert_restored_from_the_neighbour(job: Job, step: int) -> None:
    """The last attempt: rank 0 from its memory tier on n1, rank 1 on the spare n3 from n1's copy of its shards."""
    rank0, rank1 = job.events("restored", "rank0")[-1], job.events("restored", "rank1")[-1]
    assert (rank0["step"], rank0["tier"], rank0["node"]) == (step, "memory", "n1"), rank0
    assert (rank1["step"], rank1["tier"], rank1["node"]) == (step, "peer", "n3"), rank1
    log = (job.run_dir / "logs" / f"attempt{len(job.events('start')) - 1}-rank1.log").read_text()
    assert f"fetched the peer copy of step {step} (process_1" in log and f"step {step} (peer tier)" in log


def test_a_node_failing_every_attempt_is_excluded_after_the_budget_and_the_spare_finishes(budget):
    job = budget
    starts = job.events("start")
    assert [[w["node"] for w in s["workers"]] for s in starts] == [["n1", "n2"], ["n1", "n2"], ["n1", "n3"]]
    crashes = job.events("crash")
    assert [(c["node"], c["attempt"]) for c in crashes] == [("n2", 0), ("n2", 1)], crashes
    assert all("InjectedFault" in c["message"] for c in crashes)
    (exclusion,) = job.events("exclusion")
    assert (exclusion["node"], exclusion["replaced_by"], exclusion["reason"]) == ("n2", "n3", "2 failures")
    (end,) = job.events("job_end")
    assert end["state"] == "succeeded" and end["restarts"] == 2 and end["excluded"] == ["n2"], end
    assert [r["step"] for r in job.events("resumed")] == [4, 4]
    assert_restored_from_the_neighbour(job, 4)


def test_a_lost_node_is_replaced_by_the_spare_and_its_ranks_restore_from_the_peer_copy(jobs, cluster, budget):
    job = jobs("node-loss")
    # n2 goes once its rank's newest shards are in n1's memory and its next save is not due yet
    job.wait_for(lambda: 8 in job.peer_copies("n1", 1) and job.step() >= 9, "step 8's copy on n1")
    _kill_node(cluster, "n2", job.memory)
    newest = max(job.peer_copies("n1", 1))
    try:
        assert job.wait() == 0, job.out[-5000:]
    finally:
        _revive(cluster, "n2")
    starts = job.events("start")
    assert [[w["node"] for w in s["workers"]] for s in starts] == [["n1", "n2"], ["n1", "n3"]]
    (lost,) = [e for e in job.events() if e["kind"] == "node_lost" or (e["kind"] == "crash"
                                                                        and "slurmd" in e.get("message", ""))]
    assert lost["node"] == "n2", lost
    (exclusion,) = job.events("exclusion")
    assert (exclusion["node"], exclusion["replaced_by"], exclusion["reason"]) == ("n2", "n3", "node lost")
    (end,) = job.events("job_end")
    assert end["state"] == "succeeded" and end["restarts"] == 1 and end["excluded"] == ["n2"], end
    assert_same_numbers(job, budget)  # (the budget job resumed step 4 twice, this one step 8)
    (resumed,) = job.events("resumed")
    assert resumed["step"] == newest and resumed["lost_steps"] <= EVERY, resumed  # nothing lost past the copy
    assert_restored_from_the_neighbour(job, newest)


def test_a_killed_coordinator_leaves_no_worker_running(jobs, cluster, tmp_path):
    # The allocation lives on after the launcher, and the job would train for minutes: only the launcher's death
    # can end the workers within the deadline below.
    job = jobs("orphans", then="sleep 120", steps=20000)
    job.wait_for(lambda: job.step() >= 2, "step 2")
    status = json.loads((job.run_dir / "watchdog.json").read_text())
    launcher = status["pid"]
    assert len(_workers_of(job.run_dir.parent)) == 2
    os.kill(launcher, signal.SIGKILL)
    deadline = time.monotonic() + 60  # SIGTERM, the worker's save, Slurm's KillWait: seconds, on a busy machine

    def steps() -> list[str]:  # (a step is listed until its slurmstepd has cleaned up after its task)
        listed = subprocess.run(["squeue", "-s", "-h", "-o", "%j", "-n", "orphans"], capture_output=True, text=True,
                                env=cluster, timeout=30).stdout.split()
        return [s for s in listed if s.startswith("angel-jax.")]

    while (_workers_of(job.run_dir.parent) or steps()) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = {pid: Path(f"/proc/{pid}/cmdline").read_bytes()[:200] for pid in _workers_of(job.run_dir.parent)}
    assert not left, f"workers outlived their coordinator: {left}"
    assert job.proc.poll() is None, "the allocation ended with the launcher: the test would prove nothing"
    assert not steps(), steps()
