"""Recovery across nodes under a real Slurm: the three-node cluster of scripts/slurm_cluster.sh, `angel-jax
launch --spares 1` inside an `salloc -N 3` allocation, two ranks with their state sharded over them (mesh.fsdp 2:
each process checkpoints its own shards into its node's memory tier, and every snapshot is copied to the next
node's memory over TCP, checkpoint.peer_network).

    python experiments/bench/recovery_slurm.py [--write] [--conf DIR/slurm.conf] [--scenarios a,b] [key=value ...]

Without --conf it starts a cluster of its own (root; ports 16817, 16901-16903: no other cluster may run) and
stops it at the end. Run dirs, memory tiers and peer stores live in a temporary directory; each node's memory
tier and peer store are directories of their own (checkpoint.memory_dir .../{node}), so a killed node's snapshots
are gone.

Scenarios (the config: experiments/gpt_tiny.yaml, no evaluation, a checkpoint every 10 steps):

  sigkill           rank 1's worker on n2 SIGKILLed after step --kill-at: one restart on the same nodes
  node_loss         n2 killed whole after step --kill-at (its slurmd, the slurmstepd of its job steps, its worker,
                    its memory tier and peer store): the node probe finds it lost, the spare n3 takes rank 1,
                    which restores its shards from the copy n1 holds
  node_loss_nopeer  the same with checkpoint.peer_network=never: rank 1 restores from the persistent tier
  goodput           300 steps, a checkpoint every 25: rank 1 raises on n2 at step 100 (attempt 0), then n2 is
                    killed whole after step 200; the launcher's goodput report
  restore_sweep     no job, one process: a snapshot of --sweep-mib MiB restored --repeats times (each by a new manager)
                    from the memory tier, from another receiver over loopback TCP (NetworkPeerTier: list, fetch,
                    checksums) and from the persistent tier (orbax; warm page cache, and with the files evicted
                    from it)

Figures, one JSON line each (appended to experiments/results/recovery_slurm_<platform>.jsonl with --write):

  <scenario>.detection_s      the fault (this process's kill) -> the watchdog's crash / node_lost event
  <scenario>.first_step_s     the fault -> the first completed step after the restart (with the watchdog's
                              breakdown: teardown, restart = spawn to restoring, restore, compile)
  <scenario>.restore_s        the restoring rank's read of its checkpoint (`restored` event: the agreement on a
                              step, the tier's read and checksums; the ranks wait for each other), per tier
  <scenario>.lost_steps       steps computed before the fault and again after it
  goodput.goodput / .badput_<category>_s / .wall_s
  restore_sweep.<tier>_s      seconds to restore the snapshot, with its GB/s
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from angel_jax.benchinfo import emit, logged_step, machine_info, results_path  # noqa: E402
from angel_jax.tee.events import read_events  # noqa: E402

SCENARIOS = ("sigkill", "node_loss", "node_loss_nopeer", "goodput", "restore_sweep")
RESILIENCE = ["resilience.hang_timeout_min=30", "resilience.slow_phase_timeout=300", "resilience.stop_grace=3",
              "resilience.heartbeat_interval=0.5", "resilience.max_restarts=3", "resilience.exclude_after=2"]


class Cluster:
    def __init__(self, conf: Path | None, workdir: Path):
        self.own = conf is None
        self.dir = workdir / "slurm"
        if self.own:
            done = subprocess.run(["bash", str(ROOT / "scripts" / "slurm_cluster.sh"), "start", str(self.dir), "3"],
                                  capture_output=True, text=True, timeout=300)
            if done.returncode:
                raise SystemExit(f"no Slurm cluster: {done.stderr.strip()}")
            conf = self.dir / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(conf), JAX_PLATFORMS="cpu")
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), self.env.get("PYTHONPATH")) if p)

    def stop(self) -> None:
        if self.own:
            subprocess.run(["bash", str(ROOT / "scripts" / "slurm_cluster.sh"), "stop", str(self.dir)], timeout=60)

    def kill_node(self, node: str, memory: Path) -> None:
        """Everything of `node` at once: its slurmd, the slurmstepd of its steps and their tasks, its RAM."""
        self._script("kill-node", node)
        for tier in (memory / node, memory / f"{node}.peer"):
            shutil.rmtree(tier, ignore_errors=True)

    def _script(self, command: str, node: str) -> None:
        subprocess.run(["bash", str(ROOT / "scripts" / "slurm_cluster.sh"), command,
                        str(Path(self.env["SLURM_CONF"]).parent), node], check=True, timeout=60, env=self.env)

    def revive(self, node: str) -> None:
        self._script("revive", node)
        for _ in range(150):  # until the controller sees it idle again (the next job wants all three nodes)
            out = subprocess.run(["sinfo", "-h", "-N", "-n", node, "-o", "%t"], capture_output=True, text=True,
                                 env=self.env, timeout=30).stdout.split()
            if out and out[0] == "idle":
                return
            time.sleep(0.2)


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def run_job(cluster: Cluster, workdir: Path, name: str, overrides: list[str], *, faults: str = "",
            kills: list[tuple[int, str]] = (), limit: float = 1800) -> dict:
    """One launch; each (step, how) in `kills` is done once metrics.jsonl reaches the step: 'sigkill' (rank 1's
    worker) or 'node' (n2 killed whole). Returns the events, the time of each kill and the goodput report."""
    run_dir, memory = workdir / name, workdir / f"{name}.memory"
    args = [f"train.run_dir={run_dir}", f"checkpoint.memory_dir={memory}/{{node}}", "train.log_every=1",
            "train.eval_every=0", "mesh.fsdp=2", f"resilience.compile_cache_dir={workdir / 'cache'}", *RESILIENCE,
            *overrides]
    launch = [sys.executable, "-m", "angel_jax.cli", "launch", "--spares", "1", "-n", "2",
              str(ROOT / "experiments" / "gpt_tiny.yaml"), *args]
    env = dict(cluster.env, **({"ANGEL_JAX_FAULTS": faults} if faults else {}))
    with open(workdir / f"{name}.out", "w") as out:
        proc = subprocess.Popen(["timeout", "-s", "KILL", str(int(limit)), "salloc", "-N", "3", "--no-kill", "-Q",
                                 f"--job-name={name}", *launch], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    sent: list[float] = []
    revive: list[str] = []
    try:
        for at, how in kills:
            while logged_step(run_dir) < at:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name}: the job ended before step {at}:\n{_tail(workdir / f'{name}.out')}")
                time.sleep(0.005)
            if how == "sigkill":
                workers = json.loads((run_dir / "watchdog.json").read_text())["workers"]
                os.kill(next(w["pid"] for w in workers if w["rank"] == 1), signal.SIGKILL)
            else:
                cluster.kill_node("n2", memory)
                revive.append("n2")
            sent.append(time.time())
        rc = proc.wait(timeout=limit)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for node in revive:
            cluster.revive(node)
    if rc != 0:
        raise RuntimeError(f"{name}: launch exited {rc}:\n{_tail(workdir / f'{name}.out')}")
    events = list(read_events(run_dir / "events.jsonl"))
    return {"events": events, "sent": sent, "goodput": json.loads((run_dir / "goodput.json").read_text())}


def recovery_figures(job: dict, attempt: int = 1, sent: float | None = None) -> dict:
    wd = [e for e in job["events"] if e["source"] == "watchdog"]
    sent = job["sent"][0] if sent is None else sent
    fault = next(e for e in wd if e.get("fatal") and e.get("attempt") == attempt - 1)
    first = next(e for e in wd if e["kind"] == "first_step" and e["attempt"] == attempt)
    resumed = next(e for e in wd if e["kind"] == "resumed" and e["attempt"] == attempt)
    start = next(e for e in wd if e["kind"] == "start" and e["attempt"] == attempt)
    restored = [e for e in job["events"] if e["kind"] == "restored" and e["time"] >= start["time"]]
    recovered = next(e for e in wd if e["kind"] == "recovered" and e["attempt"] == attempt)
    out = {"fault": fault["kind"], "detection_s": fault["time"] - sent, "first_step_s": first["time"] - sent,
           "breakdown": {k: v for k, v in recovered.items() if k.endswith("_s") and k != "detection_s"},
           "lost_steps": resumed["lost_steps"], "resumed_step": resumed["step"],
           "nodes": [w["node"] for w in start["workers"]],
           "restores": {e["source"]: {"tier": e["tier"], "node": e["node"], "read_s": e["read_s"]} for e in restored}}
    return out


def restore_sweep(workdir: Path, mib: int, repeats: int) -> dict[str, list[float]]:
    """One process: a snapshot of `mib` MiB saved through memory -> network peer -> orbax, then restored by a
    manager that has only the memory tier, only the peer (another receiver, as a rank moved to a spare), only the
    persistent tier (warm, then evicted from the page cache)."""
    import numpy as np

    from angel_jax.checkpoint import CheckpointManager, CheckpointOptions
    from angel_jax.checkpoint import peer_wire as wire
    from angel_jax.checkpoint.peer_receiver import PeerReceiver

    token, run = "c" * 64, "d" * 32
    shm = Path(tempfile.mkdtemp(prefix="recovery-sweep-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    rng = np.random.default_rng(0)
    state = {f"w{i}": rng.standard_normal(mib * (1 << 20) // 32, dtype=np.float32) for i in range(8)}
    persistent = workdir / "sweep-persistent"
    receiver = PeerReceiver(token, shm / "n2.peer", keep_last=1).start()

    def manager(memory: Path, store: Path, *, peer: bool) -> CheckpointManager:
        network = wire.NetworkPeer(token, run, "process_1", store, receiver.address,
                                   sources=(receiver.address,)) if peer else None
        return CheckpointManager(CheckpointOptions(persistent_dir=persistent, memory_dir=memory, keep_last=1,
                                                   peer_network=network))

    def timed(memory: Path, want: str, *, peer: bool, evict: bool = False) -> list[float]:
        """Restores by a new manager each time (a new process's view: nothing fetched or listed before)."""
        took = []
        for _ in range(repeats):
            if evict:  # the persistent tier's files out of the page cache: a cold read from the disk
                for path in persistent.rglob("*"):
                    if path.is_file():
                        fd = os.open(path, os.O_RDONLY)
                        os.fsync(fd)
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                        os.close(fd)
            with manager(memory, Path(f"{memory}.peer"), peer=peer) as engine:
                t0 = time.perf_counter()
                restored = engine.restore()
                took.append(time.perf_counter() - t0)
                assert restored.source == want, (restored.source, want)
                assert all(np.array_equal(restored.arrays[k], v) for k, v in state.items())
                del restored
        return took

    out: dict[str, list[float]] = {}
    try:
        with manager(shm / "n1", shm / "n1.peer", peer=True) as engine:
            engine.save(10, state, {})
            engine.wait()
        out["memory_s"] = timed(shm / "n1", "memory", peer=True)
        out["peer_s"] = timed(shm / "n3", "peer", peer=True)  # n3: its memory tier empty, the copy on n2
        out["persistent_warm_s"] = timed(shm / "n4", "persistent", peer=False)
        out["persistent_evicted_s"] = timed(shm / "n5", "persistent", peer=False, evict=True)
    finally:
        receiver.close()
        shutil.rmtree(shm, ignore_errors=True)
    out["bytes"] = [sum(v.nbytes for v in state.values())]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="config overrides for every job")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--conf", type=Path, help="SLURM_CONF of a running 3-node cluster (else one is started)")
    p.add_argument("--kill-at", type=int, default=25, help="the fault after this step (a checkpoint every 10)")
    p.add_argument("--sweep-mib", type=int, default=256, help="restore_sweep's snapshot size")
    p.add_argument("--repeats", type=int, default=5, help="restore_sweep: restores per tier (the median is the figure)")
    p.add_argument("--write", action="store_true", help="append the figures to experiments/results/")
    args = p.parse_args(argv)
    scenarios = args.scenarios.split(",")
    machine = machine_info()
    results = results_path("recovery_slurm") if args.write else None
    base = {"bench": "recovery_slurm", "config": "experiments/gpt_tiny.yaml", "workers": 2, "nodes": 3,
            "spares": 1, "mesh_fsdp": 2}

    def put(figure: str, value: float, unit: str, **extra) -> None:
        emit({**base, "figure": figure, "value": round(value, 4), "unit": unit, **extra,
              "loadavg_1m": round(os.getloadavg()[0], 2)}, results, machine)

    with tempfile.TemporaryDirectory(prefix="recovery-slurm-") as tmp:
        workdir = Path(tmp)
        if "restore_sweep" in scenarios:
            sweep = restore_sweep(workdir, args.sweep_mib, args.repeats)
            nbytes = sweep["bytes"][0]
            for key in ("memory_s", "peer_s", "persistent_warm_s", "persistent_evicted_s"):
                median = statistics.median(sweep[key])
                put(f"restore_sweep.{key}", median, "s", bytes=nbytes, gb_per_s=round(nbytes / median / 1e9, 3),
                    samples=[round(v, 4) for v in sweep[key]], link="loopback TCP (one machine)")
        jobs = [s for s in scenarios if s != "restore_sweep"]
        if not jobs:
            return 0
        cluster = Cluster(args.conf, workdir)
        try:
            short = ["train.steps=40", "checkpoint.every=10", *args.overrides]
            for name in [s for s in jobs if s != "goodput"]:
                extra = ["checkpoint.peer_network=never"] if name == "node_loss_nopeer" else []
                job = run_job(cluster, workdir, name, short + extra,
                              kills=[(args.kill_at, "sigkill" if name == "sigkill" else "node")])
                f = recovery_figures(job)
                how = {"kill_at_step": args.kill_at, "fault": f["fault"], "nodes_after": f["nodes"],
                       "overrides": short + extra}
                put(f"{name}.detection_s", f["detection_s"], "s", target="<= 2 s",
                    target_met=f["detection_s"] <= 2.0, **how)
                put(f"{name}.first_step_s", f["first_step_s"], "s", target="<= 20 s",
                    target_met=f["first_step_s"] <= 20.0, breakdown=f["breakdown"], **how)
                put(f"{name}.lost_steps", f["lost_steps"], "steps", resumed_step=f["resumed_step"], **how)
                for source, r in sorted(f["restores"].items()):
                    put(f"{name}.restore_s", r["read_s"], "s", rank=source, tier=r["tier"], node=r["node"], **how)
            if "goodput" in jobs:
                overrides = ["train.steps=300", "checkpoint.every=25", *args.overrides]
                job = run_job(cluster, workdir, "goodput", overrides, faults="raise@100:node=n2:attempt=0",
                              kills=[(200, "node")])
                report = job["goodput"]
                how = {"faults": ["raise@100 on n2 (attempt 0)", "n2 killed whole after step 200"],
                       "overrides": overrides, "restarts": report.get("restarts"),
                       "recomputed_steps": report.get("lost_steps")}
                put("goodput.goodput", report["goodput"], "fraction", **how)
                put("goodput.wall_s", report["wall_s"], "s", **how)
                for category, seconds in report["badput_s"].items():
                    put(f"goodput.badput_{category}_s", seconds, "s", **how)
                second = recovery_figures(job, attempt=2, sent=job["sent"][0])
                put("goodput.node_loss_detection_s", second["detection_s"], "s", **how)
                put("goodput.node_loss_first_step_s", second["first_step_s"], "s", breakdown=second["breakdown"],
                    **how)
                for source, r in sorted(second["restores"].items()):
                    put("goodput.node_loss_restore_s", r["read_s"], "s", rank=source, tier=r["tier"],
                        node=r["node"], **how)
        finally:
            cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
