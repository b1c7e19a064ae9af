"""The heartbeat wire format and server (heartbeat.py) with real sockets: token and shape checks, hostile lines,
rate-limited rejection logs, and a client that never disturbs training.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from angel_jax.tol.heartbeat import (MAX_CONNECTIONS, HeartbeatClient, HeartbeatServer, Rejected, RejectionLimiter,
                                     decode, encode, sign)
from tol_drive import TOKEN


def _body(**over) -> dict:
    body = {"v": 1, "kind": "heartbeat", "rank": 0, "attempt": 0, "seq": 1, "time": 1.5, "pid": 7, "node": "local0",
            "step": 3, "phase": "training", "loss": 2.5, "step_time": 0.1, "times": [[3, 0.1]], "busy": [[3, 0.01]],
            "cache": {"hits": 1}}
    body.update(over)
    return body


@pytest.mark.parametrize("line, reason", [
    (b"not json", "malformed: not JSON"),
    (b'{"body": {}, "mac": "00"}', "unauthenticated"),
    (b"[1, 2]", "malformed: expected"),
    (b'{"body": {"a": NaN}, "mac": "00"}', "malformed: body cannot be canonicalised"),
    (b"x" * 70000, "oversized"),
    (b"[" * 30000 + b"]" * 30000, "malformed: not JSON"),
])
def test_decode_rejects_garbage(line, reason):
    with pytest.raises(Rejected, match=reason):
        decode(line, TOKEN, 2)


def test_decode_checks_the_mac_then_the_shape():
    assert decode(encode(TOKEN, _body()).strip(), TOKEN, 2) == _body()
    with pytest.raises(Rejected, match="unauthenticated"):
        decode(encode("wrong-token", _body()).strip(), TOKEN, 2)
    tampered = json.loads(encode(TOKEN, _body()))
    tampered["body"]["step"] = 999
    with pytest.raises(Rejected, match="unauthenticated"):
        decode(json.dumps(tampered).encode(), TOKEN, 2)
    for bad, reason in [({"rank": 2}, "rank 2 outside 0..1"), ({"phase": "napping"}, "unknown phase"),
                        ({"step": "3"}, "'step' = '3' has the wrong type"), ({"kind": "reboot"}, "unknown kind"),
                        ({"extra": 1}, "unknown fields \\['extra'\\]"), ({"step": True}, "wrong type"),
                        ({"times": [[1, 2, 3]]}, "'times'"), ({"v": 2}, "protocol version")]:
        body = _body(**bad)
        line = json.dumps({"body": body, "mac": sign(TOKEN, body)}).encode()
        with pytest.raises(Rejected, match=reason):
            decode(line, TOKEN, 2)


def test_server_delivers_signed_messages_and_rejects_the_rest(tmp_path):
    server = HeartbeatServer(TOKEN, 2).start()
    try:
        client = HeartbeatClient(server.address, TOKEN, rank=1, attempt=0, interval=0.2, node="local1").start()
        client.on_phase("training", 4)
        client.on_step(5, {"loss": 2.0, "perf/step_time": 0.25})
        client.on_checkpoint(8, {"stall_s": 0.01})
        client.on_anomaly({"detector": "nan", "requested": "rollback", "step": 5})  # handled in-process: not sent
        client.on_anomaly({"detector": "memory_growth", "requested": "restart", "step": 5, "message": "leak"})
        client.stop(exit_code=0)
        host, port = server.address.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b'{"hello": 1}\n' + encode(TOKEN, _body(rank=7)) + encode("guess", _body())
                      + encode(TOKEN, _body(seq=99)))  # the last is after an unauthenticated line: never read
        items = _drain(server, until=lambda xs: sum(x[0] == "rejected" for x in xs) >= 3)
    finally:
        server.close()
    messages = [x[2] for x in items if x[0] == "message"]
    kinds = [m["kind"] for m in messages]
    assert "checkpoint" in kinds and "anomaly" in kinds and kinds[-1] == "exit"
    assert all(m["rank"] == 1 and m["node"] == "local1" for m in messages)
    assert [m["seq"] for m in messages] == sorted(m["seq"] for m in messages)
    (anomaly,) = [m for m in messages if m["kind"] == "anomaly"]
    assert (anomaly["detector"], anomaly["action"], anomaly["anomaly_step"], anomaly["message"]) == (
        "memory_growth", "restart", 5, "leak")
    assert any(m["kind"] == "heartbeat" and m["step"] == 5 and m["loss"] == 2.0 and m["times"] == [[5, 0.25]]
               for m in messages)
    reasons = [x[3] for x in items if x[0] == "rejected"]
    assert reasons[0].startswith("malformed: expected") and reasons[1] == "malformed: rank 7 outside 0..1"
    assert reasons[2].startswith("unauthenticated") and len(reasons) == 3
    assert not any(m.get("seq") == 99 for m in messages)


def test_hostile_lines_are_rejected_not_raised():
    """Lines that once raised inside the server instead of being rejected: a 5000-digit integer (Python refuses to
    read integers of > 4300 digits) and a MAC with non-ASCII characters (hmac.compare_digest refuses them)."""
    huge = b'{"body": {"kind": "heartbeat", "rank": ' + b"9" * 5000 + b'}, "mac": "00"}'
    with pytest.raises(Rejected, match="malformed: not JSON"):
        decode(huge, TOKEN, 2)
    body = _body()
    line = json.dumps({"body": body, "mac": "\u00e9" * 64}).encode()
    with pytest.raises(Rejected, match="malformed: expected"):
        decode(line, TOKEN, 2)
    server = HeartbeatServer(TOKEN, 2).start()
    try:
        host, port = server.address.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as s:
            s.sendall(huge + b"\n" + line + b"\n" + encode(TOKEN, body))
        items = _drain(server, until=lambda xs: any(x[0] == "message" for x in xs))
    finally:
        server.close()
    assert [x[0] for x in items] == ["rejected", "rejected", "message"]  # the server lived on and kept reading


def test_rejections_are_rate_limited_per_sender():
    limiter = RejectionLimiter(per_window=3, window_s=60.0)
    said = [limiter.admit("10.0.0.1", t) for t in range(10)]  # one flooding sender
    assert [log for log, _ in said] == [True] * 3 + [False] * 7 and not any(s for _, s in said)
    assert limiter.admit("10.0.0.2", 5.0) == (True, None)  # another sender has its own budget
    log, summary = limiter.admit("10.0.0.1", 61.0)  # the next window: logged, with the count of the last one
    assert log and summary == "7 more rejected lines from 10.0.0.1 in 61 s (not logged one by one)"
    assert limiter.admit("10.0.0.1", 62.0) == (True, None)


def _drain(server: HeartbeatServer, until, timeout: float = 10.0) -> list:
    items, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            items.append(server.inbox.get(timeout=0.05))
        except Exception:  # noqa: BLE001 - queue.Empty
            if until(items):
                break
    return items


def _send(address: str, data: bytes) -> None:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:
        s.sendall(data)


def test_client_without_a_coordinator_does_not_disturb_training():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        client = HeartbeatClient(f"127.0.0.1:{port}", TOKEN, rank=0, attempt=0, interval=0.05).start()
        client.on_step(1, {"loss": 1.0})
        time.sleep(0.2)
        client.stop(exit_code=1, error="boom")  # returns; nothing raised


# ------------------------------------------------------------------------------------- stalled and idle clients

HALF_LINE = b'{"body": {"kind": "heartbeat", "rank": 0'  # and then nothing, not even a newline


def test_a_flood_of_stalled_connections_holds_a_bounded_number_of_threads():
    """200 clients that each send half a line and stall (issue 35: 7 threads grew to 165): the server keeps at most
    MAX_CONNECTIONS + one per rank of them (a new connection closes the oldest unauthenticated one), so its thread
    count stays bounded, and a real worker's heartbeat still gets through in the middle of the flood."""
    server = HeartbeatServer(TOKEN, 2).start()
    host, port = server.address.rsplit(":", 1)
    base, peak, stalled = threading.active_count(), 0, []
    try:
        for _ in range(200):
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(HALF_LINE)
            stalled.append(s)
            peak = max(peak, threading.active_count() - base)
        client = HeartbeatClient(server.address, TOKEN, rank=1, attempt=0, interval=0.2).start()
        client.on_step(7, {"loss": 1.0})
        items = _drain(server, until=lambda xs: any(x[0] == "message" and x[2]["step"] == 7 for x in xs))
        client.stop()
        time.sleep(0.3)  # the threads of evicted connections end
        after = threading.active_count() - base
    finally:
        for s in stalled:
            s.close()
        server.close()
    limit = MAX_CONNECTIONS + 2
    assert peak <= limit + 8 and after <= limit + 2, (peak, after)
    assert any(x[0] == "message" and x[2]["step"] == 7 and x[2]["rank"] == 1 for x in items)
    assert any(x[0] == "rejected" and x[3].startswith("dropped:") for x in items)


def test_half_lines_and_idle_connections_are_closed_after_their_deadlines():
    server = HeartbeatServer(TOKEN, 2, idle_timeout=0.6, line_timeout=0.3).start()
    host, port = server.address.rsplit(":", 1)
    try:
        half = [socket.create_connection((host, int(port)), timeout=5) for _ in range(5)]
        idle, idle_from = socket.create_connection((host, int(port)), timeout=5), time.monotonic()
        for s in half:
            s.sendall(HALF_LINE)
        slow = socket.create_connection((host, int(port)), timeout=5)  # a whole line in pieces, under the deadline
        line = encode(TOKEN, _body(step=9))
        slow.sendall(line[:20])
        time.sleep(0.1)
        slow.sendall(line[20:])
        start = time.monotonic()
        closed = [s.recv(1) for s in half]  # b"": the server hung up (a timeout here raises)
        half_s = time.monotonic() - start
        assert idle.recv(1) == b"" and time.monotonic() - idle_from >= 0.5  # idle: closed at its own deadline
        items = _drain(server, until=lambda xs: sum(x[0] == "rejected" for x in xs) >= 5)
        for s in half + [idle, slow]:
            s.close()
    finally:
        server.close()
    assert closed == [b""] * 5 and half_s < 2.0
    reasons = [x[3] for x in items if x[0] == "rejected"]
    assert len(reasons) == 5 and all(r.startswith("stalled: half a line") for r in reasons)  # idle is not a rejection
    assert [x[2]["step"] for x in items if x[0] == "message"] == [9]


def test_client_reconnects_after_the_server_closed_its_idle_connection():
    """A worker that sends less often than the server's idle timeout (a long heartbeat interval, a stopped
    process) loses no message: the client notices the close before writing and reconnects."""
    server = HeartbeatServer(TOKEN, 2, idle_timeout=0.2).start()
    try:
        client = HeartbeatClient(server.address, TOKEN, rank=0, attempt=0, interval=30.0).start()
        for step in range(1, 5):
            client.on_step(step, {"loss": 1.0})
            time.sleep(0.5)  # the server has closed the connection by now
        client.stop(exit_code=0)
        items = _drain(server, until=lambda xs: any(x[0] == "message" and x[2]["kind"] == "exit" for x in xs))
    finally:
        server.close()
    messages = [x[2] for x in items if x[0] == "message"]
    assert [m["seq"] for m in messages] == list(range(1, len(messages) + 1)), [m["seq"] for m in messages]
    assert {1, 2, 3, 4} <= {m["step"] for m in messages if m["kind"] == "heartbeat"}
