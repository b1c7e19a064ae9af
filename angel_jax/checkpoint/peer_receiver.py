"""The receiving end of the peer copy over the network: one small TCP server per training process, holding the
snapshots other nodes send it in this node's peer store, and handing them back on restore (peer_wire.py says
what travels).

    store/<run>/<key>/step_<k>/      data.bin + index.json, the snapshot format (snapshot.py)
    store/<run>/<key>/step_<k>.tmp/  a copy on its way in: checked against its index's checksums, then renamed

The store lives beside the node's memory tier (RAM, node-local): a copy here is the neighbour's backup of a
snapshot that lives in another node's memory, so losing that node loses no snapshot.

Bounds: at most `max_connections` requests at once (more are closed at once), `timeout` seconds for any receive
or send, frames of at most peer_wire.MAX_FRAME bytes, and room: a copy is refused, before any of its bytes is
read, when the store would hold more than `max_bytes` with it (0 = no fixed limit), or, on a RAM-backed store,
when it would leave the machine less than memtier.RAM_MARGIN of available RAM. Copies the key's retention drops
once the new one lands (the `keep_last` newest per key) count as free, and are removed first when the room is
needed. A refused or failed copy leaves nothing behind; the sender reports it and training goes on.
"""

from __future__ import annotations

import errno
import logging
import socket
import socketserver
import threading
from pathlib import Path
from typing import Any

import psutil

from angel_jax.checkpoint import snapshot as snap
from angel_jax.checkpoint import peer_wire as wire
from angel_jax.checkpoint.memtier import RAM_MARGIN, in_ram
from angel_jax.checkpoint.retention import steps_to_keep
from angel_jax.checkpoint.trust import untrusted

log = logging.getLogger(__name__)

MAX_LOGGED = 20
"""Refused requests logged one by one; later ones are counted."""


class _Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True
    request_queue_size = 64
    owner: "PeerReceiver"

    def verify_request(self, request: Any, client_address: Any) -> bool:
        return self.owner._admit()


class PeerReceiver:
    """Serves this node's peer store on (host, port); `start()` binds and returns it, `close()` stops it."""

    def __init__(self, token: str, store: Path, *, keep_last: int, host: str = "127.0.0.1", port: int = 0,
                 max_bytes: int = 0, timeout: float = 30.0, max_connections: int = 16):
        self.token, self.store, self.keep_last = token, Path(store), keep_last
        self.host, self.port, self.max_bytes, self.timeout = host, port, max_bytes, timeout
        self.max_connections = max_connections
        self._lock = threading.Lock()  # connection count, reservations, and every rename/delete in the store
        self._open = 0
        self._reserved = 0  # bytes of copies being received
        self._refused = 0
        self._server: _Server | None = None

    @property
    def address(self) -> tuple[str, int]:
        assert self._server is not None, "start() first"
        host, port = self._server.server_address[:2]
        return host, port

    def start(self) -> PeerReceiver:
        self.store.mkdir(mode=0o700, parents=True, exist_ok=True)  # private: no other user reads or plants copies
        if reason := untrusted(self.store, root=True):
            raise OSError(errno.EPERM, f"peer store {self.store} {reason}")
        owner = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                try:
                    owner._serve(self.request, f"{self.client_address[0]}:{self.client_address[1]}")
                finally:
                    with owner._lock:
                        owner._open -= 1

        server = _Server((self.host, self.port), Handler, bind_and_activate=False)
        server.owner = self
        try:
            server.server_bind()
            server.server_activate()
        except OSError:
            server.server_close()
            raise
        self._server = server
        threading.Thread(target=server.serve_forever, args=(0.1,), name="peer-receiver", daemon=True).start()
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _admit(self) -> bool:
        with self._lock:
            if self._open >= self.max_connections:
                return False
            self._open += 1
            return True

    # ------------------------------------------------------------------------------------------- requests

    def _serve(self, sock: socket.socket, peer: str) -> None:
        sock.settimeout(self.timeout)
        wire.buffers(sock)
        try:
            body = wire.recv_frame(sock, self.token)
            op, run, key = body.get("op"), body.get("run"), body.get("key")
            if (body.get("v") != wire.VERSION or op not in wire.OPS or not isinstance(run, str)
                    or not wire.RUN_RE.match(run) or not isinstance(key, str) or not wire.KEY_RE.match(key)):
                raise wire.PeerRefused(f"malformed request: op {op!r}, run {run!r}, key {key!r}")
            getattr(self, f"_{op}")(sock, body, wire.key_dir(self.store, run, key))
        except (wire.PeerRefused, OSError, ValueError) as e:
            self._refuse(sock, peer, str(e) or type(e).__name__)

    def _refuse(self, sock: socket.socket, peer: str, reason: str) -> None:
        with self._lock:
            self._refused += 1
            count = self._refused
        if count <= MAX_LOGGED:
            log.warning("peer copy from %s refused: %s", peer, reason)
        try:
            wire.reply(sock, self.token, ok=False, error=reason)
        except OSError:
            pass

    def _step(self, body: dict) -> int:
        step = body.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise wire.PeerRefused(f"malformed request: step {step!r}")
        return step

    def _list(self, sock: socket.socket, body: dict, where: Path) -> None:
        committed, _ = snap.scan(where)
        steps = [[s, snap.dir_bytes(p)] for s, p in sorted(committed.items())]
        wire.reply(sock, self.token, ok=True, steps=steps)

    def _get(self, sock: socket.socket, body: dict, where: Path) -> None:
        step = self._step(body)
        path = snap.step_dir(where, step)
        try:
            index = snap.read_index(path)
        except FileNotFoundError:
            raise wire.PeerRefused(f"no copy of step {step} here") from None
        except (ValueError, KeyError, TypeError) as e:
            raise wire.PeerRefused(f"the copy of step {step} has an unreadable index ({e})") from None
        snap.check_named_step(path, index, step)
        wire.reply(sock, self.token, ok=True, index=index.to_json())
        wire.send_data(sock, path, index.data_bytes)

    def _drop(self, sock: socket.socket, body: dict, where: Path) -> None:
        with self._lock:
            snap.remove_dir(where)
        wire.reply(sock, self.token, ok=True)

    def _put(self, sock: socket.socket, body: dict, where: Path) -> None:
        step = self._step(body)
        index = wire.parse_index(body.get("index"), step)
        nbytes = index.data_bytes
        self._make_room(where, step, nbytes)
        tmp, final = snap.tmp_dir(where, step), snap.step_dir(where, step)
        try:
            snap.remove_dir(tmp)
            wire.reply(sock, self.token, ok=True)  # it fits: send the bytes
            wire.receive_data(sock, tmp, nbytes)
            with self._lock:
                wire.commit_checked(tmp, final, index)
        except BaseException:
            snap.remove_dir(tmp)  # a failed copy keeps no space
            raise
        finally:
            with self._lock:
                self._reserved -= nbytes
        self._retain(where)
        wire.reply(sock, self.token, ok=True)

    # ------------------------------------------------------------------------------------------- room

    def _make_room(self, where: Path, step: int, nbytes: int) -> None:
        """Reserves `nbytes` for a copy of `step` or raises PeerRefused saying why it does not fit. Copies of
        other runs (a run that earlier lived at this path) are removed; copies of this key that retention drops
        once `step` lands count as free, and are removed now when the room is needed."""
        run_dir = where.parent
        with self._lock:
            for child in self.store.iterdir() if self.store.is_dir() else ():
                if child != run_dir and wire.RUN_RE.match(child.name) and not child.is_symlink():
                    snap.remove_dir(child)
            committed, _ = snap.scan(where)
            keep = steps_to_keep([*committed, step], self.keep_last)
            victims = [p for s, p in committed.items() if s not in keep or s == step]
            freed = sum(snap.dir_bytes(p) for p in victims)
            held = snap.dir_bytes(self.store) + self._reserved
            over_limit = self.max_bytes and held + nbytes > self.max_bytes
            if self.max_bytes and held - freed + nbytes > self.max_bytes:
                raise wire.PeerRefused(f"step {step}: a copy of {nbytes:,} B does not fit the peer store's limit "
                                       f"(checkpoint.peer_max_bytes {self.max_bytes:,} B; it holds {held:,} B, "
                                       f"{freed:,} B of them replaced by this copy)")
            short_of_ram = False
            if in_ram(self.store):
                available = int(psutil.virtual_memory().available)
                if available - (nbytes - freed) < RAM_MARGIN:
                    raise wire.PeerRefused(f"step {step}: a copy of {nbytes:,} B would leave this node "
                                           f"{available - nbytes + freed:,} B of RAM available (keeping "
                                           f"{RAM_MARGIN:,} B free)")
                short_of_ram = available - nbytes < RAM_MARGIN
            if over_limit or short_of_ram:  # the room is needed before the copy lands: the old copies go first
                for path in victims:
                    snap.remove_dir(path)
            self._reserved += nbytes

    def _retain(self, where: Path) -> None:
        with self._lock:
            committed, _ = snap.scan(where)
            keep = steps_to_keep(committed, self.keep_last)
            for s, path in committed.items():
                if s not in keep:
                    snap.remove_dir(path)
