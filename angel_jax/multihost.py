"""What the processes of a `jax.distributed` job agree on: process 0's value everywhere, whether any process says
yes, every process's short list. Each is a collective (every process calls it, in the same order); with one
process each returns at once."""

from __future__ import annotations

import os
import socket
from typing import Mapping

import jax
import numpy as np


def processes_on_this_host(env: Mapping[str, str] | None = None) -> int:
    """The training processes that share this machine (its cores and RAM): what `angel-jax launch -n N` started
    here (ANGEL_JAX_LOCAL_PROCESSES), or srun's tasks per node (SLURM_NTASKS_PER_NODE, e.g. "4(x2)"), else 1."""
    env = os.environ if env is None else env
    local = env.get("ANGEL_JAX_LOCAL_PROCESSES") or env.get("SLURM_NTASKS_PER_NODE") or "1"
    try:
        return max(1, int(local.split("(")[0].split(",")[0]))
    except ValueError:
        return 1


def node_name(env: Mapping[str, str] | None = None) -> str:
    """The node this process runs on, as the scheduler names it (the launcher's ANGEL_JAX_NODE, Slurm's
    SLURMD_NODENAME), else the host's name."""
    env = os.environ if env is None else env
    return env.get("ANGEL_JAX_NODE") or env.get("SLURMD_NODENAME") or socket.gethostname()


def own_address(node: str | None = None) -> str:
    """This machine's IPv4 address as the cluster resolves its name (`node`, then the host's name): what processes
    on other nodes dial; 127.0.0.1 where neither resolves."""
    for name in ([node] if node else []) + [socket.gethostname()]:
        try:
            return socket.gethostbyname(name)
        except OSError:
            continue
    return "127.0.0.1"


def barrier(name: str) -> None:
    """Wait until every process has reached the barrier `name`."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def every_process_lists(values: list[int], most: int = 64) -> list[list[int]]:
    """Every process's list of (at most `most`) non-negative ints below 2**31 (they cross as int32), by process."""
    if jax.process_count() == 1:
        return [list(values[:most])]
    from jax.experimental import multihost_utils

    padded = np.full(most, -1, np.int64)
    padded[:min(len(values), most)] = values[:most]
    every = np.asarray(multihost_utils.process_allgather(padded)).reshape(jax.process_count(), most)
    return [[int(v) for v in row if v >= 0] for row in every]


def from_any(flag: bool) -> bool:
    """Whether `flag` is true on any process (on every process)."""
    return any(row[0] for row in every_process_lists([int(flag)]))


def from_primary(value: int) -> int:
    """Process 0's `value` on every process (what process 0 decides, all of them do)."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int64(value)))


def primary_floats(values: np.ndarray) -> np.ndarray:
    """Process 0's float64 `values` on every process (a plan's measured figures: every process plans alike)."""
    if jax.process_count() == 1:
        return np.asarray(values, np.float64)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(values, np.float64)))
