"""The peer copy's wire format: how a process sends a snapshot to another node's receiver and asks for it back.

One request per TCP connection. Every message starts with a frame, a 4-byte big-endian length and that many
bytes of JSON, `{"body": {...}, "mac": "<hex>"}`, where mac = HMAC-SHA256 keyed with the job's token over the
body's canonical JSON (sorted keys, no spaces), as heartbeats are signed (angel_jax/signing.py): the token
never travels, and a frame without the right MAC is refused before its body is read as a request. Replies are
signed the same way, so a client knows an index or a listing came from a member of the job.

    put   {"op": "put", "run", "key", "step", "index"}   <- {"ok": true} when the copy fits (or the refusal),
          then index.data_bytes raw bytes (data.bin)      <- {"ok": true} once it is checked and committed
    list  {"op": "list", "run", "key"}          <- {"ok": true, "steps": [[step, data_bytes], ...]}
    get   {"op": "get", "run", "key", "step"}   <- {"ok": true, "index"} then index.data_bytes raw bytes
    drop  {"op": "drop", "run", "key"}          <- {"ok": true}: every copy of the key removed

`run` is the run's token (the run directory's, train/tier_ownership.py: a new run at the same path never reads an
old one's copies), `key` names whose snapshots they are ("whole" for a state process 0 saves, "process_<p>" for one
process's shards). The bytes are not signed: they are checked against the checksums of the signed index
(snapshot.py's XXH3-64 per array), on arrival and again on restore, and a copy that does not match is never
committed. XXH3 detects damage, not a forger on the wire: the token keeps strangers from writing or reading copies.
"""

from __future__ import annotations

import mmap
import os
import re
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from angel_jax.checkpoint import snapshot as snap
from angel_jax.signing import envelope, verified

VERSION = 1
MAX_FRAME = 64 << 20
"""Longest accepted frame (a paged state's index lists thousands of arrays: megabytes of JSON, not gigabytes)."""
CHUNK = 64 << 20
"""Most bytes asked of one receive call."""
SOCKET_BUFFER = 4 << 20
"""Send and receive buffers of a connection (the kernel's defaults make a snapshot's transfer a third slower)."""
KEY_RE = re.compile(r"^(whole|process_\d{1,6})$")
RUN_RE = re.compile(r"^[0-9a-f]{16,64}$")
OPS = ("put", "list", "get", "drop")


class PeerRefused(Exception):
    """A frame or request the other end cannot accept; the message says why (one line)."""


@dataclass(frozen=True)
class NetworkPeer:
    """Where one process's peer copies go over the network and where it looks for them on restore."""

    token: str
    """The job's secret (ANGEL_JAX_JOB_TOKEN): every frame is signed with it."""
    run: str
    """The run's token: copies are kept per run, so a new run at the same path never restores an old one's."""
    key: str
    """Whose snapshots these are: 'whole' (a state process 0 saves) or 'process_<p>' (one process's shards)."""
    store: Path
    """This node's peer store: copies other nodes send here, and copies fetched from them on restore."""
    destination: tuple[str, int] | None
    """The receiver of the next node, where every snapshot is sent; None when the job runs on one node."""
    sources: tuple[tuple[str, int], ...] = ()
    """The receivers asked for copies on restore (every other process's)."""
    timeout: float = 30.0
    """Seconds any connect, send or receive may wait on the other end before the transfer is given up."""

    def __post_init__(self) -> None:
        if not KEY_RE.match(self.key):
            raise ValueError(f"NetworkPeer.key: 'whole' or 'process_<p>', got {self.key!r}")
        if not RUN_RE.match(self.run):
            raise ValueError(f"NetworkPeer.run: a hex run token, got {self.run!r}")
        if not self.timeout > 0:
            raise ValueError(f"NetworkPeer.timeout: must be > 0, got {self.timeout!r}")

    @property
    def root(self) -> Path:
        """This process's copies in the local store."""
        return key_dir(self.store, self.run, self.key)


def key_dir(store: Path, run: str, key: str) -> Path:
    return Path(store) / run / key


def address_text(address: tuple[str, int] | None) -> str:
    return "-" if address is None else f"{address[0]}:{address[1]}"


# ------------------------------------------------------------------------------------------------- frames


def send_frame(sock: socket.socket, token: str, body: Mapping[str, Any]) -> None:
    payload = envelope(token, body, allow_nan=True)
    if len(payload) > MAX_FRAME:
        raise PeerRefused(f"a frame of {len(payload):,} bytes is over the limit of {MAX_FRAME:,}")
    sock.sendall(struct.pack(">I", len(payload)) + payload)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise PeerRefused(f"the connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket, token: str) -> dict[str, Any]:
    """A verified frame's body; PeerRefused naming the problem (oversized, not JSON, wrong MAC)."""
    (length,) = struct.unpack(">I", recv_exact(sock, 4))
    if length > MAX_FRAME:
        raise PeerRefused(f"oversized: a frame of {length:,} bytes (the limit is {MAX_FRAME:,})")
    return verified(recv_exact(sock, length), token, PeerRefused, allow_nan=True, object_body=True)


def request(peer: NetworkPeer, address: tuple[str, int], op: str, **fields: Any) -> tuple[socket.socket, dict]:
    """Connects to `address`, sends one request and returns (the open socket, its reply's body); raises
    PeerRefused (a refused request, the reply's error) or OSError (no connection, a timeout)."""
    sock = socket.create_connection(address, timeout=peer.timeout)
    try:
        sock.settimeout(peer.timeout)
        buffers(sock)
        send_frame(sock, peer.token, {"v": VERSION, "op": op, "run": peer.run, "key": peer.key, **fields})
        return sock, expect_ok(sock, peer.token)
    except BaseException:
        sock.close()
        raise


def buffers(sock: socket.socket) -> None:
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)


def expect_ok(sock: socket.socket, token: str) -> dict[str, Any]:
    """The next reply's body; PeerRefused with the other end's reason when it says no."""
    body = recv_frame(sock, token)
    if not body.get("ok"):
        raise PeerRefused(str(body.get("error") or "refused without a reason"))
    return body


def reply(sock: socket.socket, token: str, **fields: Any) -> None:
    send_frame(sock, token, {"v": VERSION, **fields})


# ------------------------------------------------------------------------------------------------- data


def send_data(sock: socket.socket, directory: Path, nbytes: int) -> None:
    """The data file of a committed snapshot, `nbytes` of it, from the page cache to the socket (sendfile)."""
    if nbytes == 0:
        return
    with open(directory / snap.DATA_FILE, "rb") as f:
        if os.fstat(f.fileno()).st_size != nbytes:
            raise PeerRefused(f"{directory / snap.DATA_FILE}: not {nbytes} bytes as its index says")
        sock.sendfile(f, 0, nbytes)


def receive_data(sock: socket.socket, directory: Path, nbytes: int) -> None:
    """`nbytes` from the socket into `directory`/data.bin, reserved first (a full tier fails here with ENOSPC,
    cleanly, not with SIGBUS inside a write through a mapping) and filled in place."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(directory / snap.DATA_FILE, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        if nbytes == 0:
            return
        os.posix_fallocate(fd, 0, nbytes)
        with mmap.mmap(fd, nbytes) as mm:
            _receive_into(sock, mm, nbytes)
    finally:
        os.close(fd)


def receive_buffer(sock: socket.socket, nbytes: int) -> np.ndarray:
    """`nbytes` from the socket into a new buffer of this process's memory."""
    data = np.empty(nbytes, np.uint8)
    _receive_into(sock, data, nbytes)
    return data


def _receive_into(sock: socket.socket, buffer: Any, nbytes: int) -> None:
    """`nbytes` from the socket into `buffer` (anything with the buffer protocol), CHUNK at a time."""
    view, got = memoryview(buffer), 0
    try:
        while got < nbytes:
            k = sock.recv_into(view[got:got + CHUNK])
            if k == 0:
                raise PeerRefused(f"the sender closed the connection after {got:,} of {nbytes:,} bytes")
            got += k
    finally:
        view.release()


def arrays_in(index: snap.SnapshotIndex, data: np.ndarray) -> dict[str, np.ndarray]:
    """Views of a received data file's bytes (`data`, uint8) laid out by `index`: each array at its offset."""
    arrays = {}
    for a in index.arrays:
        dtype = snap.decode_dtype(a.dtype)
        if a.offset + a.nbytes > data.size:
            raise snap.SnapshotDamaged([f"array {a.name!r} extends past the {data.size:,} bytes received"])
        arrays[a.name] = data[a.offset:a.offset + a.nbytes].view(dtype).reshape(a.shape)
    return arrays


def commit_checked(tmp: Path, final: Path, index: snap.SnapshotIndex) -> None:
    """Checks a received copy in `tmp` against its index's checksums, writes the index and renames it to `final`
    (the commit). Raises PeerRefused naming every damaged array; `tmp` is left for the caller to remove."""
    if any(a.checksum is None for a in index.arrays):
        raise PeerRefused(f"step {index.step}: the index has arrays without checksums")
    try:
        _, views = snap.map_data(tmp, index, private=False)
    except snap.SnapshotDamaged as e:
        raise PeerRefused("; ".join(e.problems)) from None
    problems = snap.verify_arrays(index, views, None, str(final))
    del views
    if problems:
        raise PeerRefused("; ".join(problems))
    snap.write_index(tmp, index)
    snap.replace_dir(tmp, final)


def parse_index(raw: Any, step: int) -> snap.SnapshotIndex:
    """A signed request's index, checked: its own checksum, and the step it claims."""
    try:
        index = snap.SnapshotIndex.from_json(raw)
    except (ValueError, KeyError, TypeError) as e:
        raise PeerRefused(f"step {step}: unreadable index ({e})") from None
    if index.step != step:
        raise PeerRefused(f"the index holds step {index.step}, the request says step {step}")
    return index
