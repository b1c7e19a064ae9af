"""Where an attempt's workers run: this machine's processes (`launch -n N` anywhere), or job steps of a Slurm
allocation (`launch` inside `sbatch` / `salloc`).

A `Placement` answers four questions for the launcher, and nothing else differs between the two:

    nodes            the node names the watchdog may use, in order: the first `needed` run the job, the rest are
                     spares that replace a node excluded after repeated failures (or lost)
    ranks_per_node   how many workers share a node (they share its cores: the host kernel's threads per rank)
    command(...)     the argv that starts one rank on its node (locally: the worker itself; under Slurm: one
                     `srun --jobid J --nodelist NODE -N1 -n1 --overlap` job step per rank, so the exit status of
                     every rank reaches the watchdog on its own, the first exit being the cause)
    addresses        where the workers reach the heartbeat server, and the host of jax.distributed's coordinator
                     (the first node of each attempt)

Why a job step per rank rather than one step of all ranks: `srun` reports one exit status for the whole step,
so a rank killed on one node and its peers failing a second later in a broken collective would look alike; with a
step per rank the watchdog sees which rank on which node failed first, as it does with local processes. Stopping a
step: SIGTERM to its `srun` is forwarded to the task (the worker saves and exits), and two SIGINTs within a second
make `srun` cancel the step. Each `srun` dies with the launcher (PR_SET_PDEATHSIG: SIGTERM, forwarded to its
task), so a coordinator killed by SIGKILL leaves no worker running.
"""

from __future__ import annotations

import ctypes
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from angel_jax.errors import AngelError
from angel_jax.multihost import own_address

_PR_SET_PDEATHSIG = 1


class AllocationError(AngelError):
    """The Slurm allocation cannot run the job as asked (too few nodes, no srun, a node list that cannot be read)."""


def tasks_per_node(value: str) -> list[int]:
    """Slurm's SLURM_TASKS_PER_NODE / SLURM_JOB_CPUS_PER_NODE syntax, expanded: '2(x3),1' -> [2, 2, 2, 1]."""
    out: list[int] = []
    for part in filter(None, value.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            raise AllocationError(f"cannot read the tasks per node {value!r} (expected e.g. '2(x3),1')")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def inside_allocation(env: Mapping[str, str]) -> bool:
    """In an sbatch script or an salloc shell (a job, not one of its steps: there `srun` would nest)."""
    return bool(env.get("SLURM_JOB_ID")) and bool(env.get("SLURM_JOB_NODELIST")) and not env.get("SLURM_STEP_ID")


def expand_nodelist(nodelist: str, run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> list[str]:
    """'n[1-3],gpu7' -> ['n1', 'n2', 'n3', 'gpu7'], by Slurm itself (`scontrol show hostnames`)."""
    try:
        done = run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise AllocationError(f"cannot expand the allocation's node list {nodelist!r} with scontrol: {e}") from None
    names = done.stdout.split()
    if done.returncode or not names:
        raise AllocationError(f"scontrol show hostnames {nodelist!r} failed: {done.stderr.strip() or 'no names'}")
    return names


@dataclass(frozen=True)
class Placement:
    """Local processes: every rank on this machine, nodes named local0, local1, ... (one per rank, spares after)."""

    nodes: tuple[str, ...]
    ranks_per_node: int = 1
    heartbeat_host: str = "127.0.0.1"
    """The address the heartbeat server binds and the workers dial."""
    kind: str = "local"

    @classmethod
    def local(cls, workers: int, spares: int) -> Placement:
        return cls(tuple(f"local{i}" for i in range(workers + spares)))

    def command(self, argv: Sequence[str], *, node: str, rank: int, attempt: int) -> list[str]:
        return list(argv)

    def coordinator_host(self, first_node: str) -> str:
        return "127.0.0.1"

    def worker_env(self, launcher_pid: int) -> dict[str, str]:
        """What every worker's environment gets besides its place in the job."""
        return {"ANGEL_JAX_WATCHDOG_PID": str(launcher_pid)}  # a local worker dies with its launcher

    def preexec(self) -> Callable[[], None] | None:
        return None

    @property
    def stop_signals(self) -> tuple[int, ...]:
        """Signals sent after the stop grace, before SIGKILL."""
        return ()


@dataclass(frozen=True)
class SlurmPlacement(Placement):
    """Job steps of the allocation `job_id`; nodes in the allocation's order."""

    job_id: str = ""
    kind: str = "slurm"

    @classmethod
    def from_env(cls, env: Mapping[str, str], *, workers: int | None, spares: int, ranks_per_node: int | None,
                 run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> tuple[SlurmPlacement, int]:
        """The allocation this process runs in, and the number of workers: `workers` if given, else every
        node of the allocation but `spares` times the ranks per node. Ranks per node: the flag, else the
        allocation's --ntasks-per-node (SLURM_NTASKS_PER_NODE), else its GPUs per node, else 1."""
        nodes = expand_nodelist(env["SLURM_JOB_NODELIST"], run)
        per_node = ranks_per_node or _int(env.get("SLURM_NTASKS_PER_NODE")) or _gpus(env) or 1
        if workers is None:
            workers = (len(nodes) - spares) * per_node
        needed = -(-workers // per_node) if workers > 0 else 0
        if workers < 1 or needed + spares > len(nodes):
            raise AllocationError(
                f"the allocation {env.get('SLURM_JOB_ID')} has {len(nodes)} node(s) ({','.join(nodes)}); "
                f"{workers} worker(s) at {per_node} per node need {needed} node(s) plus --spares {spares}")
        if workers % per_node:
            raise AllocationError(f"{workers} workers do not fill nodes of {per_node} ranks each "
                                  "(-n must be a multiple of the ranks per node)")
        host = own_address()
        return cls(tuple(nodes), per_node, host, job_id=env["SLURM_JOB_ID"]), workers

    def command(self, argv: Sequence[str], *, node: str, rank: int, attempt: int) -> list[str]:
        return ["srun", f"--jobid={self.job_id}", f"--nodelist={node}", "--nodes=1", "--ntasks=1", "--overlap",
                "--kill-on-bad-exit=0", "--export=ALL", f"--job-name=angel-jax.a{attempt}.r{rank}", "--quiet",
                *argv]

    def coordinator_host(self, first_node: str) -> str:
        return first_node

    def worker_env(self, launcher_pid: int) -> dict[str, str]:
        return {}  # a worker's parent is slurmstepd: it dies with its srun's step instead

    def preexec(self) -> Callable[[], None] | None:
        return _term_with_parent if sys.platform.startswith("linux") else None

    @property
    def stop_signals(self) -> tuple[int, ...]:
        return (signal.SIGINT, signal.SIGINT)  # twice within a second: srun cancels the step


def _term_with_parent() -> None:
    """In the srun child before exec: SIGTERM when the launcher dies; srun forwards it to its task."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


def _int(value: str | None) -> int | None:
    return int(value) if value and value.isdigit() else None


def _gpus(env: Mapping[str, str]) -> int | None:
    return _int(env.get("SLURM_GPUS_ON_NODE")) or _int(env.get("SLURM_GPUS_PER_NODE"))


def daemon_addresses(nodes: Sequence[str], run: Callable[..., subprocess.CompletedProcess] = subprocess.run
                     ) -> dict[str, tuple[str, int]]:
    """node -> (address, port) of its slurmd, from `scontrol show node -o`; nodes it cannot read are left out."""
    try:
        done = run(["scontrol", "show", "node", "-o", ",".join(nodes)], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    out: dict[str, tuple[str, int]] = {}
    for line in done.stdout.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        name, addr, port = fields.get("NodeName"), fields.get("NodeAddr"), fields.get("Port")
        if name and addr and port and port.isdigit():
            out[name] = (addr, int(port))
    return out


def silent_daemons(daemons: Mapping[str, tuple[str, int]], nodes: Sequence[str], *, timeout: float = 1.0,
                   tries: int = 2, gap: float = 0.5) -> list[str]:
    """The nodes among `nodes` whose slurmd answers no TCP connection in `tries` tries `gap` seconds apart (nothing
    is sent: a connect is the whole probe). Asked when a rank fails, so that a failure is charged to the node that
    vanished rather than to the peer whose collective broke first; a machine that is gone or cut off answers no
    connection. Nodes whose daemon address is unknown are never reported."""
    silent = [n for n in dict.fromkeys(nodes) if n in daemons]
    for attempt in range(tries):
        if attempt:
            time.sleep(gap)
        silent = [n for n in silent if not answers(*daemons[n], timeout)]
        if not silent:
            break
    return silent


def answers(addr: str, port: int, timeout: float) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return True
    except OSError:
        return False
