"""Heartbeats: workers report step, loss, step time and phase to the watchdog over a loopback TCP socket.

Wire format: one JSON object per line, `{"body": {...}, "mac": "<hex>"}`, where mac = HMAC-SHA256 keyed with the
job's token (a random secret the launcher hands each worker in ANGEL_JAX_JOB_TOKEN) over the body's canonical JSON
(sorted keys, no spaces; angel_jax/signing.py). The token itself never travels. The server checks, in this order:
line length, JSON, the MAC (`hmac.compare_digest`), then the body's exact shape; anything else is rejected with a
reason and dropped before the watchdog sees it. A connection whose MAC is wrong is closed.

The server bounds what idle or hostile clients can hold (each connection is a thread): at most MAX_CONNECTIONS
connections besides one per rank (a new one past that closes the oldest that has not yet sent an authenticated line,
or, when every open one has, itself at once), IDLE_TIMEOUT seconds without a byte, and LINE_TIMEOUT seconds from a
line's first byte to its newline (half a line and a stall). A client whose connection was closed reconnects.

Body fields (every message):
    v 1, kind heartbeat|checkpoint|anomaly|exit, rank, attempt, seq (per sender, increasing), time (sender's
    clock), pid, node, step (last completed step), phase (init, setup, restoring, compiling, training,
    checkpointing, evaluating, done)
    heartbeat: loss, step_time (the newest step's, or null), busy ([[step, seconds], ...]: each step's time outside
               waiting for the device, which tells a straggling rank in synchronous data parallelism, where every
               rank's step time is the same), times ([[step, seconds], ...] since the last
               message), cache ({"requests": n, "hits": n}: JAX's persistent compilation cache)
    checkpoint: ckpt_step, stall_s                  the blocking part of a save is over (process 0)
    anomaly: detector, action, anomaly_step, anomaly_rank, message      a detector asked for restart / exclude
    exit: code, error                               the worker is about to exit with this status

`HeartbeatClient` is the worker's side: a training hook whose background thread sends the newest state every
`interval` seconds and at once on a completed step (at most every 50 ms), a checkpoint or an anomaly (a phase
change is sent by the training thread itself, before it enters the phase), so heartbeats keep flowing during
compilation and long steps; the step number in them is what tells progress from mere liveness (a SIGSTOPped process sends nothing at all; one stuck in a collective keeps sending
the same step).
"""

from __future__ import annotations

import logging
import math
import os
import queue
import select
import socket
import socketserver
import threading
import time
from typing import Any, Callable, Iterator, Mapping

from angel_jax.config.fields import ConfigError, typed
from angel_jax.phases import WORKER_PHASES, Phase
from angel_jax.signing import envelope, sign, verified  # noqa: F401 (sign: how a heartbeat is signed)
from angel_jax.train.hooks import TrainHooks

log = logging.getLogger(__name__)

VERSION = 1
MAX_LINE = 64 * 1024
"""Longest accepted line in bytes; a longer one is rejected and its connection closed."""
KINDS = ("heartbeat", "checkpoint", "anomaly", "exit")
STEP_MIN_INTERVAL = 0.05
"""Step-only updates are sent at most this often (phase changes, checkpoints and anomalies at once)."""
MAX_TIMES = 64
CONNECT_TIMEOUT = 2.0
RETRY_AFTER = 5.0
"""After a failed send, messages are dropped for this many seconds before the next connection attempt."""
MAX_LOGGED_REJECTIONS = 20
"""Per connection: later rejections are counted, not logged one by one (a flood must not fill the disk)."""
MAX_CONNECTIONS = 64
"""Connections open at once besides one per rank; past that, the oldest not yet authenticated one is closed."""
IDLE_TIMEOUT = 30.0
"""Seconds a connection may send nothing before the server closes it (a worker's client then reconnects)."""
LINE_TIMEOUT = 10.0
"""Seconds from a line's first byte to its newline; a client that sends half a line and stalls is dropped."""

_COMMON = {"v": int, "kind": str, "rank": int, "attempt": int, "seq": int, "time": float, "pid": int, "node": str,
           "step": int, "phase": str}
_BY_KIND: dict[str, dict[str, Any]] = {
    "heartbeat": {"loss": float | None, "step_time": float | None, "times": list, "busy": list, "cache": dict},
    "checkpoint": {"ckpt_step": int, "stall_s": float},
    "anomaly": {"detector": str, "action": str, "anomaly_step": int, "anomaly_rank": int | None, "message": str},
    "exit": {"code": int, "error": str},
}


class Rejected(ValueError):
    """A line the server refuses; the message is the reason."""


# --------------------------------------------------------------------------------------------- wire format


def encode(token: str, body: Mapping[str, Any]) -> bytes:
    return envelope(token, body) + b"\n"


def _typed(value: Any, tp: Any) -> bool:
    """Whether a JSON value has the schema's type (the configs' strict check: no bool for int, finite floats)."""
    try:
        typed(value, tp, "field")
    except ConfigError:
        return False
    return True


def validate(body: Any, n_ranks: int) -> dict[str, Any]:
    """The body's exact shape, or Rejected naming the first problem."""
    if not isinstance(body, dict):
        raise Rejected(f"malformed: body is a {type(body).__name__}, not an object")
    kind = body.get("kind")
    if kind not in KINDS:
        raise Rejected(f"malformed: unknown kind {kind!r}")
    schema = {**_COMMON, **_BY_KIND[kind]}
    unknown = sorted(set(body) - set(schema))
    missing = sorted(set(schema) - set(body))
    if unknown or missing:
        raise Rejected(f"malformed {kind}: unknown fields {unknown}, missing fields {missing}")
    for key, tp in schema.items():
        if not _typed(body[key], tp):
            raise Rejected(f"malformed {kind}: field {key!r} = {body[key]!r} has the wrong type")
    if body["v"] != VERSION:
        raise Rejected(f"malformed: protocol version {body['v']}, expected {VERSION}")
    if not 0 <= body["rank"] < n_ranks:
        raise Rejected(f"malformed: rank {body['rank']} outside 0..{n_ranks - 1}")
    if body["phase"] not in WORKER_PHASES:
        raise Rejected(f"malformed: unknown phase {body['phase']!r}")
    if body["step"] < 0 or body["attempt"] < 0:
        raise Rejected("malformed: negative step or attempt")
    if kind == "heartbeat":
        for key in ("times", "busy"):
            pairs = body[key]
            if len(pairs) > MAX_TIMES or not all(isinstance(p, list) and len(p) == 2 and _typed(p[0], int)
                                                 and _typed(p[1], float) for p in pairs):
                raise Rejected(f"malformed heartbeat: {key!r} must be at most 64 [step, seconds] pairs")
        if not all(isinstance(k, str) and _typed(v, int) for k, v in body["cache"].items()):
            raise Rejected("malformed heartbeat: 'cache' must map names to counts")
    return body


def decode(line: bytes, token: str, n_ranks: int) -> dict[str, Any]:
    """A verified message body from one line, or Rejected."""
    if len(line) > MAX_LINE:
        raise Rejected(f"oversized: a line of more than {MAX_LINE} bytes")
    return validate(verified(line, token, Rejected), n_ranks)


class RejectionLimiter:
    """Which rejections are worth an event: at most `per_window` per sender (host) per `window_s` seconds; the
    rest are counted and reported as one summary when the sender's next window opens. A flood of hostile
    connections then costs a few lines per minute in events.jsonl, not one per connection. Used by one thread
    (the watchdog's), so it needs no lock."""

    def __init__(self, per_window: int = 10, window_s: float = 60.0):
        self.per_window, self.window_s = per_window, window_s
        self._windows: dict[str, tuple[float, int, int]] = {}  # sender -> (window start, logged, dropped)

    def admit(self, sender: str, now: float) -> tuple[bool, str | None]:
        """(log this rejection?, a summary of the sender's previous window's dropped ones, or None)."""
        start, logged, dropped = self._windows.get(sender, (now, 0, 0))
        summary = None
        if now - start >= self.window_s:
            if dropped:
                summary = f"{dropped} more rejected lines from {sender} in {now - start:.0f} s (not logged one by one)"
            start, logged, dropped = now, 0, 0
        if logged < self.per_window:
            self._windows[sender] = (start, logged + 1, dropped)
            return True, summary
        self._windows[sender] = (start, logged, dropped + 1)
        return False, summary


# --------------------------------------------------------------------------------------------- server


class Stalled(Exception):
    """A connection that sent half a line and then nothing within the line deadline."""


def read_lines(sock: socket.socket, *, idle_timeout: float, line_timeout: float,
               clock: Callable[[], float] = time.monotonic) -> Iterator[bytes]:
    """The lines a socket sends, without their newline: a last one cut by the peer's close as it is, and the first
    MAX_LINE + 1 bytes of one longer than MAX_LINE (which decode rejects). Ends at the peer's close, an error or
    idle_timeout seconds with no line begun; raises Stalled when a begun line takes longer than line_timeout."""
    buf = bytearray()
    started: float | None = None  # when the server first waited on the pending half line
    while True:
        newline = buf.find(b"\n")
        if newline >= 0:
            yield bytes(buf[:newline])
            del buf[:newline + 1]
            started = None
            continue
        if len(buf) > MAX_LINE:
            yield bytes(buf[:MAX_LINE + 1])
            return
        if buf and started is None:
            started = clock()
        wait = idle_timeout if started is None else started + line_timeout - clock()
        try:
            if wait <= 0:
                raise TimeoutError
            sock.settimeout(wait)
            chunk = sock.recv(65536)
        except TimeoutError:
            if started is None:
                return  # idle: closed quietly
            raise Stalled(f"stalled: half a line ({len(buf)} bytes) and no newline within {line_timeout:g} s") from None
        except OSError:
            return
        if not chunk:
            if buf:
                yield bytes(buf)
            return
        buf += chunk


class _Connections:
    """The open connections, oldest first, each with its peer and whether it has sent an authenticated line. The
    accepting thread admits (evicting when full); each connection's thread marks and removes its own, so a lock."""

    def __init__(self, limit: int):
        self.limit = limit
        self._lock = threading.Lock()
        self._open: dict[socket.socket, tuple[str, bool]] = {}

    def admit(self, sock: socket.socket, peer: str) -> tuple[bool, str | None]:
        """(admitted?, the peer of the connection closed to make room, or None)."""
        with self._lock:
            evicted = None
            if len(self._open) >= self.limit:
                victim = next((s for s, (_, trusted) in self._open.items() if not trusted), None)
                if victim is None:
                    return False, None
                evicted = self._open.pop(victim)[0]
                try:
                    victim.shutdown(socket.SHUT_RDWR)  # its thread's recv returns at once; the thread closes it
                except OSError:
                    pass
            self._open[sock] = (peer, False)
            return True, evicted

    def trust(self, sock: socket.socket) -> None:
        with self._lock:
            if sock in self._open:
                self._open[sock] = (self._open[sock][0], True)

    def remove(self, sock: socket.socket) -> None:
        with self._lock:
            self._open.pop(sock, None)


class _Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True  # a connection's thread never keeps the launcher alive
    request_queue_size = 128  # a burst of connections waits in the backlog, not in SYN retries
    admit: Callable[[socket.socket, Any], bool]

    def verify_request(self, request: Any, client_address: Any) -> bool:
        return self.admit(request, client_address)  # False: closed at once, no thread


class HeartbeatServer:
    """Accepts heartbeat connections on a loopback port; verified bodies and rejections go to `inbox` as
    ("message", arrival, body) and ("rejected", arrival, peer, reason); the watchdog's thread consumes them."""

    def __init__(self, token: str, n_ranks: int, *, host: str = "127.0.0.1", port: int = 0,
                 clock: Callable[[], float] = time.monotonic, max_connections: int | None = None,
                 idle_timeout: float = IDLE_TIMEOUT, line_timeout: float = LINE_TIMEOUT):
        self.token, self.n_ranks, self.host, self.port = token, n_ranks, host, port
        self.clock = clock
        self.idle_timeout, self.line_timeout = idle_timeout, line_timeout
        self.connections = _Connections(MAX_CONNECTIONS + n_ranks if max_connections is None else max_connections)
        self.inbox: queue.Queue = queue.Queue()
        self._server: socketserver.ThreadingTCPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        assert self._server is not None, "start() first"
        host, port = self._server.server_address[:2]
        return f"{host}:{port}"

    def start(self) -> HeartbeatServer:
        owner = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                try:
                    owner._serve(self.request, _peer(self.client_address))
                finally:
                    owner.connections.remove(self.request)

        server = _Server((self.host, self.port), Handler)
        server.admit = self._admit
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="heartbeat-server", daemon=True)
        self._thread.start()
        return self

    def _admit(self, sock: socket.socket, client_address: Any) -> bool:
        peer = _peer(client_address)
        admitted, evicted = self.connections.admit(sock, peer)
        limit = self.connections.limit
        if evicted is not None:
            self.inbox.put(("rejected", self.clock(), evicted,
                            f"dropped: {limit} connections open, the oldest unauthenticated one closed for a new one"))
        if not admitted:
            self.inbox.put(("rejected", self.clock(), peer, f"refused: {limit} authenticated connections open"))
        return admitted

    def _serve(self, sock: socket.socket, peer: str) -> None:
        logged = dropped = 0
        lines = read_lines(sock, idle_timeout=self.idle_timeout, line_timeout=self.line_timeout)
        while True:
            try:
                line = next(lines, None)
            except Stalled as e:
                self.inbox.put(("rejected", self.clock(), peer, str(e)))
                break
            if line is None:
                break
            try:
                body = decode(line, self.token, self.n_ranks)
            except Rejected as e:
                reason = str(e)
                if logged < MAX_LOGGED_REJECTIONS:
                    logged += 1
                    self.inbox.put(("rejected", self.clock(), peer, reason))
                else:
                    dropped += 1
                if reason.startswith(("unauthenticated", "oversized")):
                    break  # nothing more from a sender that does not hold the token
                continue
            self.connections.trust(sock)
            self.inbox.put(("message", self.clock(), body))
        if dropped:
            self.inbox.put(("rejected", self.clock(), peer, f"{dropped} more rejected lines on this connection"))

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def _peer(client_address: Any) -> str:
    return f"{client_address[0]}:{client_address[1]}"


# --------------------------------------------------------------------------------------------- client


class HeartbeatClient(TrainHooks):
    """The worker's reporter: a training hook plus a background sender thread.

        client = HeartbeatClient("127.0.0.1:4100", token, rank=0, attempt=0, interval=1.0).start()
        train(cfg, hooks=[client, ...])
        client.stop(exit_code=0)

    Sending never raises into training: a lost coordinator means lost heartbeats (the watchdog judges silence),
    not a failed run. `close()` (called by the loop at its end) flushes; `stop()` sends the exit report and ends
    the thread.
    """

    def __init__(self, address: str, token: str, *, rank: int, attempt: int, interval: float = 1.0,
                 node: str = "", extra: Callable[[], dict[str, Any]] | None = None):
        host, _, port = address.rpartition(":")
        self.address = (host, int(port))
        self.token, self.rank, self.attempt, self.interval, self.node = token, rank, attempt, interval, node
        self.extra = extra
        self._lock = threading.Condition()
        self._send_lock = threading.Lock()
        self._seq = 0
        self._step, self._phase = 0, Phase.INIT
        self._loss: float | None = None
        self._step_time: float | None = None
        self._times: list[list] = []
        self._busy: list[list] = []
        self._urgent: list[dict[str, Any]] = []
        self._wake = True  # the first message goes out at once
        self._running = False
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._last_step_sent = 0.0
        self._retry_at = 0.0
        self._warned = False

    # ------------------------------------------------------------------ hooks

    def on_phase(self, phase: Phase, step: int) -> None:
        # Sent from the training thread itself, before it goes on: a phase change is rare, a loopback write takes
        # microseconds, and a process killed right after entering a phase (a crash inside a checkpoint write) has
        # still told the watchdog where it died.
        with self._send_lock:
            with self._lock:
                self._phase, self._step = phase, step  # the last completed step (lower again after a rollback)
                messages = self._drain() if self._running else []
            self._send_locked(messages)

    def on_step(self, step: int, values: dict[str, float]) -> None:
        with self._lock:
            self._step = step
            self._loss = _finite(values.get("loss"))
            self._step_time = _finite(values.get("perf/step_time"))
            if self._step_time is not None:
                self._times = (self._times + [[step, self._step_time]])[-MAX_TIMES:]
            busy = _finite(values.get("perf/busy_time"))  # this rank's time outside waiting for the device
            if busy is not None:
                self._busy = (self._busy + [[step, busy]])[-MAX_TIMES:]
            self._wake = True
            self._lock.notify()

    def on_checkpoint(self, step: int, info: dict[str, Any]) -> None:
        self._send_soon({"kind": "checkpoint", "ckpt_step": step, "stall_s": float(info.get("stall_s", 0.0))})

    def on_anomaly(self, event: dict[str, Any]) -> None:
        action = str(event.get("requested") or event.get("action") or "")
        if action not in ("restart", "exclude"):
            return  # the worker logs the rest itself (events.jsonl); only these need the watchdog
        rank = event.get("rank")
        self._send_soon({"kind": "anomaly", "detector": str(event.get("detector", "?")), "action": action,
                         "anomaly_step": int(event.get("step", self._step)),
                         "anomaly_rank": self.rank if rank is None else int(rank),
                         "message": str(event.get("message", ""))[:2000]})

    def close(self) -> None:
        self.flush()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> HeartbeatClient:
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="heartbeat-client", daemon=True)
        self._thread.start()
        return self

    def flush(self) -> None:
        with self._lock:
            self._wake = True
            self._lock.notify()

    def stop(self, exit_code: int | None = None, error: str = "") -> None:
        """Ends the thread; with `exit_code`, the last message says how the worker is about to exit (sent from
        the calling thread, synchronously, so it is on the wire before the process ends)."""
        with self._lock:
            self._running = False
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._send_lock:
            with self._lock:
                messages = self._drain()
                if exit_code is not None:
                    messages.append(self._body({"kind": "exit", "code": int(exit_code), "error": error[-2000:]}))
            self._send_locked(messages)
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    # ------------------------------------------------------------------ sending

    def _send_soon(self, fields: dict[str, Any]) -> None:
        with self._lock:
            self._urgent.append(fields)
            self._wake = True
            self._lock.notify()

    def _state(self) -> dict[str, Any]:
        times, self._times = self._times, []
        busy, self._busy = self._busy, []
        return {"loss": self._loss, "step_time": self._step_time, "times": times, "busy": busy,
                "cache": self.extra() if self.extra else {}}

    def _body(self, fields: dict[str, Any]) -> dict[str, Any]:
        self._seq += 1
        return {"v": VERSION, "rank": self.rank, "attempt": self.attempt, "seq": self._seq, "time": time.time(),
                "pid": os.getpid(), "node": self.node, "step": self._step, "phase": self._phase, **fields}

    def _drain(self) -> list[dict[str, Any]]:
        """Pending messages plus a heartbeat with the newest state (call with _lock held; send in seq order)."""
        messages = [self._body(u) for u in self._urgent]
        self._urgent = []
        return messages + [self._body({"kind": "heartbeat", **self._state()})]

    def _loop(self) -> None:
        while True:
            with self._lock:
                if not self._wake and self._running:
                    self._lock.wait(timeout=self.interval)
                if not self._running:
                    return
                step_only = self._wake and not self._urgent
                wait = self._last_step_sent + STEP_MIN_INTERVAL - time.monotonic()
                if step_only and wait > 0 and self._phase == Phase.TRAINING:
                    self._lock.wait(timeout=wait)  # coalesce fast steps; a phase change or an anomaly still wakes us
                self._wake = False
            # Lock order: _send_lock, then _lock; messages are numbered and sent under both, so in seq order.
            with self._send_lock:
                with self._lock:
                    if not self._running:
                        return
                    messages = self._drain()
                self._last_step_sent = time.monotonic()
                self._send_locked(messages)

    def _send_locked(self, bodies: list[dict[str, Any]]) -> None:
        """Writes to the socket (call with _send_lock held: the training thread and the sender share it)."""
        if not bodies or time.monotonic() < self._retry_at:
            return  # a coordinator that cannot be reached costs training no time: retry later, drop meanwhile
        data = b"".join(encode(self.token, b) for b in bodies)
        for _ in range(2):  # one reconnect: the coordinator may have dropped an idle connection
            try:
                if self._sock is not None and _closed_by_peer(self._sock):
                    self._sock.close()  # the server closed it (idle): a write would vanish, so reconnect first
                    self._sock = None
                if self._sock is None:
                    self._sock = socket.create_connection(self.address, timeout=CONNECT_TIMEOUT)
                self._sock.sendall(data)
                return
            except OSError as e:
                if self._sock is not None:
                    self._sock.close()
                    self._sock = None
                if not self._warned:
                    self._warned = True
                    log.warning("heartbeat to %s:%d failed (%s); training goes on", *self.address, e)
        self._retry_at = time.monotonic() + RETRY_AFTER


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end has closed the connection (the server never writes, so any readable end is its close)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    try:
        return bool(poller.poll(0)) and sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None
