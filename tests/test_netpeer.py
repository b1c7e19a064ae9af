"""The peer copy over the network (checkpoint/netpeer.py, peer_receiver.py, peer_wire.py) against real sockets and
real files: each "node" is a memory tier, a peer store and a receiver of its own; a node is lost by deleting its
directories. Every restore is compared bitwise with a copy taken before the save."""

from __future__ import annotations

import logging
import shutil
import socket
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from angel_jax.checkpoint import CheckpointManager, CheckpointOptions
from angel_jax.checkpoint import peer_wire as wire
from angel_jax.checkpoint import snapshot as snap
from angel_jax.checkpoint.peer_receiver import PeerReceiver
from test_checkpoint_manager import assert_bitwise, copy_of, flip_byte, make_state

TOKEN = "a" * 64
RUN = "0123456789abcdef0123456789abcdef"


class Node:
    """One node: its memory tier, its peer store, its receiver."""

    def __init__(self, root: Path, name: str, **receiver):
        self.memory, self.store = root / name / "memory", root / name / "peer"
        self.receiver = PeerReceiver(receiver.pop("token", TOKEN), self.store, keep_last=receiver.pop("keep", 2),
                                     **receiver).start()
        self.address = self.receiver.address

    def lose(self) -> None:
        self.receiver.close()
        shutil.rmtree(self.memory.parent, ignore_errors=True)

    def copies(self, key: str = "process_0") -> list[int]:
        return sorted(snap.scan(wire.key_dir(self.store, RUN, key))[0])


def engine(tmp_path: Path, node: Node, *, to: Node | None, sources: tuple = (), key: str = "process_0",
           token: str = TOKEN, **kw) -> CheckpointManager:
    network = wire.NetworkPeer(token=token, run=RUN, key=key, store=node.store,
                               destination=to.address if to else None, sources=sources, timeout=kw.pop("timeout", 5.0))
    return CheckpointManager(CheckpointOptions(persistent_dir=tmp_path / "persistent", memory_dir=node.memory,
                                               peer_network=network, persistent_format="snapshot", **kw))


@pytest.fixture
def nodes(tmp_path: Path):
    made: list[Node] = []

    def make(name: str, **receiver) -> Node:
        made.append(Node(tmp_path, name, **receiver))
        return made[-1]

    yield make
    for n in made:
        n.receiver.close()


def test_every_snapshot_lands_in_the_next_nodes_memory_and_a_moved_rank_restores_the_neighbours_copy(
        tmp_path: Path, nodes) -> None:
    n1, n2, n3 = nodes("n1"), nodes("n2"), nodes("n3")
    states = {step: make_state(step) for step in (2, 4, 6)}
    expected = copy_of(states[6])
    with engine(tmp_path, n1, to=n2, keep_last=2) as e:
        for step, state in states.items():
            e.save(step, state, {"step": step})
            e.wait()
        assert [i.tiers["peer"].state for i in e.list() if "peer" in i.tiers] == ["backed_up", "backed_up"]
    assert n2.copies() == [4, 6]  # the receiver keeps checkpoint.keep copies, as every tier does
    assert not list(wire.key_dir(n2.store, RUN, "process_0").glob("*.tmp"))
    n1.lose()  # its memory tier and its receiver are gone; the rank moves to n3, whose tiers are empty
    with engine(tmp_path, n3, to=n2, sources=(n2.address,)) as e:
        assert [(i.step, sorted(i.tiers)) for i in e.list()] == [(4, ["peer", "persistent"]),
                                                                (6, ["peer", "persistent"])]
        restored = e.restore()
        assert (restored.step, restored.source) == (6, "peer")
        assert_bitwise(restored.arrays, expected)
        restored.arrays["page_u8"][0] ^= 1  # writable, as every restored array
    assert not list(n3.store.rglob("step_*"))  # fetched into the process's memory: nothing written to n3's store


def test_a_copy_the_receiver_cannot_take_is_reported_and_the_save_goes_on(tmp_path: Path, nodes, caplog) -> None:
    small = nodes("small", max_bytes=50_000)  # a snapshot is 98,304 B
    stranger = nodes("stranger", token="b" * 64)
    state = make_state(1)
    for name, to in (("a", small), ("b", stranger)):
        with caplog.at_level(logging.WARNING), engine(tmp_path / name, nodes(name), to=to) as e:
            handle = e.save(3, state, {})
            handle.wait()
            assert handle.state == "persisted"
            (error,) = e.poll_errors()
            assert error.stage == "peer" and "peer copy failed" in str(error)
        assert to.copies() == [] and not list(to.store.rglob("*.tmp"))
    assert "does not fit the peer store's limit (checkpoint.peer_max_bytes 50,000 B" in caplog.text
    assert "unauthenticated: the MAC does not match the job's token" in caplog.text


def test_no_receiver_on_the_other_end_costs_the_save_nothing_but_the_peer_copy(tmp_path: Path, nodes) -> None:
    n1 = nodes("n1")
    gone = nodes("gone")
    gone.lose()
    with engine(tmp_path, n1, to=gone, sources=(gone.address,), timeout=2.0) as e:
        handle = e.save(1, make_state(1), {})
        handle.wait()
        assert handle.state == "persisted" and "sending step 1 to the receiver" in str(e.poll_errors()[0])
        shutil.rmtree(n1.memory)
        assert e.restore().source == "persistent"


def test_a_damaged_copy_is_never_committed_nor_restored(tmp_path: Path, nodes, caplog) -> None:
    n1, n2, n3 = nodes("n1"), nodes("n2"), nodes("n3")
    state = make_state(5)
    # Bytes that do not match the signed index's checksums: refused, nothing committed.
    index = snap.checksummed(snap.plan_layout(5, state, {}), state, None)
    sock, _ = wire.request(wire.NetworkPeer(TOKEN, RUN, "process_0", n1.store, None), n2.address, "put", step=5,
                           index=index.to_json())
    with sock:
        sock.sendall(b"\x01" * index.data_bytes)
        with pytest.raises(wire.PeerRefused, match="checksum mismatch"):
            wire.expect_ok(sock, TOKEN)
    assert n2.copies() == [] and not list(n2.store.rglob("*.tmp"))
    # A copy damaged in the receiver's memory after its commit: the restore fetches it, finds it damaged, and
    # falls back to the persistent tier.
    with engine(tmp_path, n1, to=n2) as e:
        e.save(5, state, {})
        e.wait()
    flip_byte(snap.step_dir(wire.key_dir(n2.store, RUN, "process_0"), 5) / snap.DATA_FILE)
    n1.lose()
    with caplog.at_level(logging.WARNING), engine(tmp_path, n3, to=n2, sources=(n2.address,)) as e:
        restored = e.restore()
    assert restored.source == "persistent"
    assert_bitwise(restored.arrays, state)
    assert "in the peer tier is damaged" in caplog.text and "checksum mismatch" in caplog.text


def test_the_receiver_closes_silent_and_surplus_connections(tmp_path: Path, nodes) -> None:
    n1 = nodes("n1", timeout=0.5, max_connections=2)
    held = [socket.create_connection(n1.address) for _ in range(2)]
    surplus = socket.create_connection(n1.address)
    surplus.settimeout(5)
    assert surplus.recv(1) == b""  # closed at once: two connections are open
    for sock in held:  # silent for longer than the timeout: refused and closed
        sock.settimeout(5)
        (length,) = struct.unpack(">I", wire.recv_exact(sock, 4))
        assert b"timed out" in wire.recv_exact(sock, length)
        assert sock.recv(1) == b""
        sock.close()
    time.sleep(0.1)
    oversized = socket.create_connection(n1.address)  # a frame longer than the limit is not read
    oversized.sendall(struct.pack(">I", wire.MAX_FRAME + 1))
    oversized.settimeout(5)
    (length,) = struct.unpack(">I", wire.recv_exact(oversized, 4))
    assert b"oversized" in wire.recv_exact(oversized, length)
    oversized.close()


def test_each_process_sends_to_its_local_index_on_the_next_node_and_each_node_has_a_memory_tier() -> None:
    from angel_jax.train.peer_network import _next_node, per_node

    node = {0: 7, 1: 7, 2: 9, 3: 9, 4: 5}  # process -> its node's hash: two nodes of 2 ranks, one of 1
    rows = [[1, 0, 1, 1000 + p, node[p]] for p in node]
    receivers = {p: ("0.0.0.1", 1000 + p) for p in node}
    assert [_next_node(rows, p, receivers)[1] for p in node] == [1002, 1003, 1004, 1004, 1000]
    assert _next_node([[1, 0, 1, 1000, 7], [1, 0, 1, 1001, 7]], 0, receivers) is None  # one node: no peer
    del receivers[2], receivers[3]  # node 9 has no receiver: its neighbours send past it
    assert [_next_node(rows, p, receivers)[1] for p in node] == [1004, 1004, 1004, 1004, 1000]
    assert per_node("/dev/shm/x/{node}/m", {"SLURMD_NODENAME": "n2"}) == "/dev/shm/x/n2/m"
    assert per_node("/dev/shm/x/{node}", {"ANGEL_JAX_NODE": "n3", "SLURMD_NODENAME": "n2"}) == "/dev/shm/x/n3"
