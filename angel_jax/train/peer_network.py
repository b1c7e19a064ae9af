"""The peer copy over the network in a training job: each process's receiver, and which node its copies go to.

Every process of a job that `angel-jax launch` runs across the nodes of a Slurm allocation (checkpoint.peer_network
'auto', or 'always' anywhere the launcher runs it) starts a receiver (checkpoint/peer_receiver.py) serving its node's
peer store, beside the node's memory tier, and the processes tell each other where theirs listen (one all-gather
of ints: address, port, a hash of the node's name). A process's copies then go to the process with its local
index on the next node of the job (the nodes in the order of their first process, cyclically), and on restore it
asks every other process's receiver for them. On one node, or without the job's token, there is no network peer.

    <memory tier of the run>.peer/<run token>/<whole | process_p>/step_<k>/      on every node

The receiver lives as long as the process: a neighbour's last copy may arrive after this process's own training
has ended and before the job's final barrier (jax.distributed.shutdown).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import zlib
from pathlib import Path
from typing import Mapping

import jax

from angel_jax.checkpoint.peer_receiver import PeerReceiver
from angel_jax.checkpoint.peer_wire import RUN_RE, NetworkPeer
from angel_jax.config import Config
from angel_jax.multihost import every_process_lists, node_name, own_address
from angel_jax.train.tier_ownership import RUN_TOKEN_FILE

log = logging.getLogger(__name__)

NODE_PLACEHOLDER = "{node}"
_RECEIVERS: dict[tuple, PeerReceiver] = {}
"""This process's receivers (one per job in practice), by what they serve."""


def per_node(path: str, env: Mapping[str, str] = os.environ) -> str:
    """checkpoint.memory_dir with '{node}' replaced by this node's name."""
    return path.replace(NODE_PLACEHOLDER, node_name(env)) if NODE_PLACEHOLDER in path else path


def wanted(cfg: Config, env: Mapping[str, str] = os.environ) -> bool:
    """Whether this job copies snapshots over the network (the same answer on every process: config and the
    launcher's environment)."""
    mode = cfg.checkpoint.peer_network
    if mode == "never" or cfg.checkpoint.peer_dir or jax.process_count() == 1:
        return False
    if not env.get("ANGEL_JAX_JOB_TOKEN"):
        if mode == "always":
            log.warning("checkpoint.peer_network=always: no peer copy, the job has no token (it is started by "
                        "`angel-jax launch`)")
        return False
    return mode == "always" or env.get("ANGEL_JAX_PLACEMENT") == "slurm"


def network_peer(cfg: Config, run_dir: Path, memory_root: Path, *, key: str,
                 env: Mapping[str, str] = os.environ) -> NetworkPeer | None:
    """This process's network peer, or None (`wanted` says no, or the job runs on one node). A collective when
    `wanted`: every process calls it, in the same order. `memory_root`: the run's memory tier on this node (the
    peer store lives beside it)."""
    if not wanted(cfg, env):
        return None
    c = cfg.checkpoint
    token = env["ANGEL_JAX_JOB_TOKEN"]
    store = Path(f"{memory_root}.peer")
    host = own_address(node_name(env))
    receiver, why = None, ""
    try:
        receiver = _receiver(token, store, host, c.peer_port + jax.process_index() if c.peer_port else 0,
                             keep_last=c.keep, max_bytes=c.peer_max_bytes, timeout=c.peer_timeout)
    except OSError as e:
        why = f"{e.strerror or e}"
    ip = int(ipaddress.IPv4Address(host))
    mine = [int(receiver is not None), ip >> 16, ip & 0xFFFF, receiver.address[1] if receiver else 0,
            _node_hash(node_name(env))]
    rows = every_process_lists(mine)  # (the processes' receivers are all listening once this returns)
    if receiver is None:
        log.warning("checkpoint.peer_network: this process's receiver could not listen on %s (%s): its node takes "
                    "no peer copies", host, why)
    run = _run_token(run_dir)
    if run is None:
        log.warning("checkpoint.peer_network: %s has no run token: no peer copy", Path(run_dir) / RUN_TOKEN_FILE)
        return None
    receivers = {p: (str(ipaddress.IPv4Address((r[1] << 16) | r[2])), r[3]) for p, r in enumerate(rows) if r[0]}
    destination = _next_node(rows, jax.process_index(), receivers)
    if destination is None:
        log.info("checkpoint.peer_network: the job runs on one node: no peer copy over the network")
        return None
    sources = tuple(a for p, a in receivers.items() if p != jax.process_index())
    log.info("peer copies of %s go to %s:%d; this node's receiver listens on %s", key, *destination,
             f"{host}:{receiver.address[1]}" if receiver else "nothing")
    return NetworkPeer(token=token, run=run, key=key, store=store, destination=destination, sources=sources,
                       timeout=c.peer_timeout)


def _next_node(rows: list[list[int]], me: int, receivers: Mapping[int, tuple[str, int]]) -> tuple[str, int] | None:
    """The receiver of the process with my local index on the next node (or that node's last one, when it has
    fewer), the nodes in the order of their first process, a node without a receiver skipped; None when no other
    node has one."""
    nodes: dict[int, list[int]] = {}
    for p, row in enumerate(rows):
        nodes.setdefault(row[4], []).append(p)
    order = list(nodes)
    here = rows[me][4]
    mine = nodes[here].index(me)
    for shift in range(1, len(order)):
        there = [p for p in nodes[order[(order.index(here) + shift) % len(order)]] if p in receivers]
        if there:
            return receivers[there[min(mine, len(there) - 1)]]
    return None


def _receiver(token: str, store: Path, host: str, port: int, **kw) -> PeerReceiver:
    key = (token, str(store), host, port, tuple(sorted(kw.items())))
    if key not in _RECEIVERS:
        _RECEIVERS[key] = PeerReceiver(token, store, host=host, port=port, **kw).start()
    return _RECEIVERS[key]


def _node_hash(name: str) -> int:
    return zlib.crc32(name.encode()) & 0xFFFFFF  # (24 bits: the all-gather's ints are int32 on the device)


def _run_token(run_dir: Path) -> str | None:
    try:
        token = (Path(run_dir) / RUN_TOKEN_FILE).read_text().strip()
    except OSError:
        return None
    return token if RUN_RE.match(token) else None
