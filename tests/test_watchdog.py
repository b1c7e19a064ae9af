"""The watchdog's pure parts with exact values: the state machine (coordinator.py, driven with an injected clock),
the goodput report (goodput.py), the heartbeat wire format and server (heartbeat.py: token and shape checks, with
real sockets), the worker's environment (worker.py) and the resilience config. Real processes and real faults are
in test_watchdog_faults.py.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from angel_jax.config import ConfigError, load_config
from angel_jax.tol import coordinator as co
from angel_jax.tol.goodput import CATEGORIES, goodput, paint
from angel_jax.tol.heartbeat import (HeartbeatClient, HeartbeatServer, Rejected, RejectionLimiter, decode,
                                            encode, sign, validate)
from angel_jax.tol.worker import WorkerEnv, ckpt_kill_for_attempt, cluster_detected

TOKEN = "t" * 64
POLICY = co.WatchdogPolicy(total_steps=16, hang_timeout_min=5.0, hang_factor=10.0, slow_phase_timeout=100.0,
                           heartbeat_lost_after=2.0, stop_grace=3.0, max_restarts=3, no_progress_limit=0,
                           exclude_after=0)


# --------------------------------------------------------------------------------------------- helpers


class Drive:
    """A Watchdog, its actions and emitted events, and per-rank message sequence numbers."""

    def __init__(self, policy: co.WatchdogPolicy = POLICY, n: int = 2, spares: int = 0):
        self.wd = co.Watchdog(policy, n_workers=n, spares=spares)
        self.actions: list = []
        self.seq: dict[int, int] = {}
        self.do(self.wd.start(0.0))

    def do(self, actions: list) -> list:
        self.actions += actions
        return actions

    def started(self, t: float, attempt: int | None = None) -> None:
        attempt = self.wd.attempt if attempt is None else attempt
        self.do(self.wd.handle(co.GroupStarted(t, attempt, {r: 100 * (attempt + 1) + r for r in range(self.wd.n)})))

    def msg(self, t: float, rank: int, step: int, phase: str = "training", kind: str = "heartbeat",
            attempt: int | None = None, **fields) -> list:
        self.seq[rank] = self.seq.get(rank, 0) + 1
        body = {"v": 1, "kind": kind, "rank": rank, "attempt": self.wd.attempt if attempt is None else attempt,
                "seq": self.seq[rank], "time": 0.0, "pid": self.wd.ranks[rank].pid, "node": "", "step": step,
                "phase": phase}
        if kind == "heartbeat":
            body.update({"loss": 1.0, "step_time": fields.pop("step_time", None), "times": fields.pop("times", []),
                         "busy": fields.pop("busy", []), "cache": {}})
        body.update(fields)
        return self.do(self.wd.handle(co.Message(t, validate(body, self.wd.n))))

    def all(self, t: float, step: int, phase: str = "training", **fields) -> None:
        for r in range(self.wd.n):
            self.msg(t, r, step, phase, **fields)

    def exit(self, t: float, rank: int, code: int) -> list:
        return self.do(self.wd.handle(co.WorkerExited(t, self.wd.attempt, rank, code)))

    def tick(self, t: float) -> list:
        return self.do(self.wd.handle(co.Tick(t)))

    def stopped(self, t: float) -> list:
        return self.do(self.wd.handle(co.GroupStopped(t, self.wd.attempt, {0: "x", 1: "y"})))

    def events(self, kind: str) -> list[dict]:
        return [a.fields for a in self.actions if isinstance(a, co.Emit) and a.kind == kind]

    def of(self, cls: type) -> list:
        return [a for a in self.actions if isinstance(a, cls)]

    def warm(self, t0: float, start_step: int = 0) -> None:
        """Spawned at t0; set-up, then compiling at start_step at t0 + 1."""
        self.started(t0)
        self.all(t0 + 0.5, 0, "setup")
        self.all(t0 + 1.0, start_step, "compiling")


# --------------------------------------------------------------------------------------------- state machine


def test_states_of_a_clean_job():
    d = Drive()
    assert d.of(co.Spawn) == [co.Spawn(0, ("local0", "local1"), True)]
    d.started(0.0)
    assert d.wd.state == co.State.STARTING
    d.msg(1.0, 0, 0, "setup")
    assert d.wd.state == co.State.STARTING  # rank 1 not heard from yet
    d.msg(1.5, 1, 0, "setup")
    assert d.wd.state == co.State.WARMUP
    d.all(2.0, 0, "compiling")
    d.all(9.0, 1, "training")
    assert d.wd.state == co.State.RUNNING
    assert d.events("first_step") == [{"attempt": 0, "step": 1, "rank": 0, "since_start_s": 9.0,
                                       "compile_cache": {"0": {}, "1": {}}}]
    for s in range(2, 17):
        d.all(9.0 + 0.1 * s, s)
    assert d.events("last_step") == [{"attempt": 0, "step": 16}]
    d.exit(11.0, 1, 0)
    assert d.wd.state == co.State.RUNNING
    d.exit(11.5, 0, 0)
    assert d.wd.state == co.State.SUCCEEDED
    assert [(e["from"], e["to"]) for e in d.events("state")] == [
        ("starting", "warmup"), ("warmup", "running"), ("running", "succeeded")]
    assert d.of(co.Finish) == [co.Finish(co.State.SUCCEEDED, "all 16 steps done in 1 attempt(s), 0 restart(s)")]
    assert not d.of(co.StopGroup)


def test_crash_stops_the_group_and_restarts_from_the_checkpoint_with_a_breakdown():
    d = Drive()
    d.warm(0.0)
    for s in range(1, 7):
        d.all(10.0 + s, s)  # step 6 at t=16
    d.exit(16.5, 1, -9)
    crash = d.events("crash")[0]
    assert crash["message"] == "rank 1 (node local1, pid 101) was killed by SIGKILL at step 6 in phase training"
    assert (crash["returncode"], crash["status"], crash["step"]) == (-9, "was killed by SIGKILL", 6) and crash["fatal"]
    assert d.wd.state == co.State.RECOVERING
    assert d.of(co.StopGroup) == [co.StopGroup(0, crash["message"], 3.0)]
    d.exit(16.6, 0, 1)  # the peer's broken collective: a consequence, not a second failure
    assert len(d.wd.failures) == 1
    d.stopped(17.0)
    assert d.of(co.Spawn)[-1] == co.Spawn(1, ("local0", "local1"), True)
    assert d.events("restart") == [{"attempt": 1, "restarts": 1, "budget": 3, "nodes": ["local0", "local1"],
                                    "after": crash["message"]}]
    d.started(17.5)
    d.all(19.0, 4, "restoring")
    d.all(20.0, 4, "compiling")
    assert d.events("resumed") == [{"attempt": 1, "step": 4, "lost_steps": 2}]
    d.msg(26.0, 1, 5)
    assert d.wd.state == co.State.RUNNING
    rec = d.events("recovered")[0]
    assert rec == {"attempt": 1, "step": 5, "detection_s": 0.0, "teardown_s": 0.5, "restart_s": 2.0,
                   "restore_s": 1.0, "compile_s": 6.0, "spawn_s": 0.5, "total_s": 9.5}


def test_hang_timeout_from_step_times_and_phases():
    p = POLICY
    assert co.hang_timeout(p, [], slow=False) == 5.0  # hang_timeout_min
    assert co.hang_timeout(p, [0.1] * 50, slow=False) == 5.0  # 10 x 0.1 < 5
    times = [1.0] * 19 + [3.0]  # nearest-rank p95 of 20 samples: the 19th = 1.0
    assert co.p95(times) == 1.0 and co.hang_timeout(p, times, slow=False) == 10.0
    assert co.hang_timeout(p, times + [3.0] * 5, slow=False) == 30.0
    assert co.hang_timeout(p, times, slow=True) == 100.0  # slow_phase_timeout


def test_hang_is_declared_after_the_timeout_and_names_the_silent_rank():
    d = Drive()
    d.warm(0.0)
    d.all(10.0, 1)
    d.all(10.1, 2, step_time=0.1, times=[[2, 0.1]])
    d.msg(10.2, 0, 3, step_time=0.1, times=[[3, 0.1]])
    d.msg(10.2, 1, 3, step_time=0.1, times=[[3, 0.1]])  # then rank 1 is stopped: silence
    for t in (11.0, 11.5, 12.0, 13.0, 14.0):
        d.msg(t, 0, 3)  # rank 0's heartbeats go on (blocked in a collective): same step, no progress
    assert d.tick(12.0) == [] and d.tick(12.2) == []
    lost = d.tick(12.3)
    assert [a.kind for a in lost] == ["heartbeat_lost"] and lost[0].fields["rank"] == 1
    assert d.tick(15.2) == []  # exactly at the timeout: not yet
    out = d.tick(15.3)
    hang = d.events("hang")[0]
    assert hang["rank"] == 1 and hang["heartbeat_lost"] is True and hang["timeout_s"] == 5.0
    assert hang["silent_s"] == 5.1 and hang["step"] == 3
    assert hang["message"] == ("rank 1 (node local1, pid 101) made no progress for 5.1 s (timeout 5.0 s) at step 3 "
                               "in phase training; its heartbeats stopped")
    assert isinstance(out[-1], co.StopGroup) and d.wd.state == co.State.RECOVERING
    assert d.tick(100.0) == []  # one failure per stall


def test_slow_phase_of_any_rank_lengthens_the_timeout():
    d = Drive()
    d.warm(0.0)
    d.all(10.0, 1)
    d.msg(10.5, 0, 4, "checkpointing")  # process 0 writes a checkpoint; rank 1 waits in the next collective
    d.msg(10.5, 1, 4, "training")
    d.tick(50.0)
    assert not d.events("hang"), "39.5 s without progress, but process 0 is checkpointing: the slow timeout (100 s)"
    d.msg(51.0, 0, 4, "training")
    d.tick(56.0)
    assert d.events("hang")[0]["rank"] == 1  # no progress since 10.5 on rank 1, and nobody is slow any more


def test_heartbeat_loss_only_after_first_contact_and_its_recovery():
    d = Drive()
    d.started(0.0)
    assert d.tick(50.0) == []  # never heard from: start-up is judged by the (slow) hang timeout only
    d.msg(50.0, 0, 0, "setup")
    d.tick(52.5)
    assert d.events("heartbeat_lost") == [{"attempt": 0, "rank": 0, "node": "local0", "silent_s": 2.5, "step": 0,
                                           "phase": "setup"}]
    d.msg(53.0, 0, 0, "setup")
    assert d.events("heartbeat_resumed") == [{"rank": 0, "attempt": 0, "silent_s": 3.0}]


def _crash_loop(policy: co.WatchdogPolicy, reach: list[int], restore: list[int]) -> Drive:
    """Attempt i resumes from restore[i], reaches step reach[i], then rank 1 exits with status 1."""
    d = Drive(policy)
    t = 0.0
    for i, (top, start) in enumerate(zip(reach, restore)):
        if d.wd.state == co.State.FAILED:
            break
        d.warm(t, start)
        for s in range(start + 1, top + 1):
            d.all(t + 2 + 0.1 * s, s)
        d.msg(t + 4, 1, top, kind="exit", code=1, error="InjectedFault: injected fault: raise@7")
        d.exit(t + 5, 1, 1)
        d.stopped(t + 6)
        t += 10
    return d


def test_restart_budget_ends_in_failed_naming_the_step_and_status():
    d = _crash_loop(POLICY.__class__(**{**POLICY.__dict__, "max_restarts": 2}), [7, 7, 7, 7], [0, 4, 4, 4])
    assert d.wd.state == co.State.FAILED
    assert len(d.of(co.Spawn)) == 3 and d.wd.restarts == 2
    (finish,) = d.of(co.Finish)
    assert finish.summary.startswith("job failed after 2 restart(s): the restart budget is spent "
                                     "(resilience.max_restarts=2). Last failure: rank 1 (node local1, pid 301) "
                                     "exited with status 1 at step 7 in phase training: InjectedFault: injected "
                                     "fault: raise@7.")
    assert d.events("job_end")[0]["failures"][0].startswith("attempt 0: rank 1")


def test_no_progress_limit_counts_restarts_without_a_new_best_step():
    policy = POLICY.__class__(**{**POLICY.__dict__, "max_restarts": 10, "no_progress_limit": 2})
    d = _crash_loop(policy, [7, 9, 9, 9, 9], [0, 4, 8, 8, 8])  # attempt 1 gets further (9 > 7): that resets
    assert d.wd.state == co.State.FAILED and d.wd.restarts == 3
    summary = d.of(co.Finish)[0].summary
    assert "2 attempt(s) in a row got no step past step 9 (resilience.no_progress_limit=2)" in summary


def test_repeated_failures_exclude_the_node_when_a_spare_is_left():
    policy = POLICY.__class__(**{**POLICY.__dict__, "exclude_after": 2})
    d = Drive(policy, spares=1)
    for attempt in range(2):
        d.warm(10.0 * attempt)
        d.all(10.0 * attempt + 3, 1)
        d.exit(10.0 * attempt + 4, 1, 1)
        d.stopped(10.0 * attempt + 5)
    assert d.events("exclusion") == [{"node": "local1", "rank": 1, "failures": 2, "reason": "2 failures",
                                      "replaced_by": "local2"}]
    assert d.of(co.Spawn)[-1] == co.Spawn(2, ("local0", "local2"), True)
    # without a spare the node stays and the job goes on (the restart budget bounds it)
    d = Drive(policy)
    for attempt in range(2):
        d.warm(10.0 * attempt)
        d.exit(10.0 * attempt + 4, 1, co.EXIT_EXCLUDE if attempt else 1)
        d.stopped(10.0 * attempt + 5)
    skipped = d.events("exclusion_skipped")[0]
    assert skipped["reason"] == "exclusion requested, but no spare node is left (launch --spares)"
    assert d.of(co.Spawn)[-1].nodes == ("local0", "local1")


def test_anomaly_reports_restart_or_log():
    d = Drive()
    d.warm(0.0)
    d.all(5.0, 3)
    d.do(d.wd.handle(co.AnomalyReport(5.5, "straggler", "log", 1, 3, "rank 1 slow")))
    assert d.events("anomaly")[0]["taken"] == "logged" and d.wd.state == co.State.RUNNING
    d.msg(6.0, 0, 3, kind="anomaly", detector="memory_growth", action="restart", anomaly_step=3, anomaly_rank=0,
          message="host memory grows")
    fatal = d.events("anomaly")[1]
    assert fatal["fatal"] and fatal["source"] == "rank0" and d.wd.state == co.State.RECOVERING
    assert d.wd.failures[0].detail == ("memory_growth on rank 0 (node local0) at step 3 asked for restart: "
                                       "host memory grows")


def test_stale_and_replayed_messages_change_nothing():
    d = Drive()
    d.warm(0.0)
    d.all(5.0, 3)
    before = {r: (v.step, v.phase, v.last_progress) for r, v in d.wd.ranks.items()}
    assert d.msg(6.0, 0, 9, attempt=1) == []  # another attempt's
    d.seq[0] -= 2
    assert d.msg(6.0, 0, 9) == []  # an old sequence number
    assert {r: (v.step, v.phase, v.last_progress) for r, v in d.wd.ranks.items()} == before


def test_exits_after_process_0_finished_are_not_failures():
    d = Drive()
    d.warm(0.0)
    d.all(5.0, 16)
    d.exit(6.0, 0, 0)
    d.exit(6.5, 1, -6)  # e.g. an abort in JAX's shutdown once its peer is gone
    assert d.wd.state == co.State.SUCCEEDED and d.events("exit_after_done")[0]["status"] == "was killed by SIGABRT"
    d = Drive()
    d.warm(0.0)
    d.all(5.0, 16)
    d.exit(6.0, 0, 0)
    assert not [a for a in d.tick(8.9) if not isinstance(a, co.Emit)]
    assert isinstance(d.tick(9.1)[-1], co.StopGroup)  # rank 1 lingers past stop_grace
    d.stopped(9.5)
    assert d.wd.state == co.State.SUCCEEDED


def test_describe_status():
    assert co.describe_status(-9) == "was killed by SIGKILL"
    assert co.describe_status(-19) == "was killed by SIGSTOP"
    assert co.describe_status(1) == "exited with status 1"
    assert co.describe_status(75) == "exited with status 75 (restart requested)"
    assert co.EXIT_RESTART == 75 and co.EXIT_EXCLUDE == 76
    from angel_jax import errors

    assert (errors.EXIT_RESTART, errors.EXIT_EXCLUDE) == (co.EXIT_RESTART, co.EXIT_EXCLUDE)


# --------------------------------------------------------------------------------------------- goodput


def _ev(t: float, kind: str, **fields) -> dict:
    return {"time": t, "kind": kind, "source": "watchdog", **fields}


def test_goodput_categories_with_exact_values():
    events = [
        _ev(100.0, "job_start"),
        _ev(101.0, "start", attempt=0),
        _ev(102.0, "phase", attempt=0, phase="setup", step=0),
        _ev(103.0, "phase", attempt=0, phase="restoring", step=0),
        _ev(104.0, "phase", attempt=0, phase="compiling", step=0),
        _ev(110.0, "first_step", attempt=0, step=1),
        _ev(110.0, "phase", attempt=0, phase="training", step=1),
        _ev(115.0, "phase", attempt=0, phase="checkpointing", step=4),
        _ev(116.0, "checkpoint", attempt=0, step=4, stall_s=1.0),
        _ev(116.0, "phase", attempt=0, phase="training", step=4),
        _ev(120.0, "hang", attempt=0, rank=1, silent_s=5.0, fatal=True),
        _ev(121.0, "stopped", attempt=0),
        _ev(121.5, "restart", attempt=1),
        _ev(122.0, "start", attempt=1),
        _ev(123.0, "phase", attempt=1, phase="restoring", step=4),
        _ev(125.0, "phase", attempt=1, phase="compiling", step=4),
        _ev(126.0, "resumed", attempt=1, step=4, lost_steps=2),
        _ev(128.0, "first_step", attempt=1, step=5),
        _ev(128.0, "phase", attempt=1, phase="training", step=5),
        _ev(138.0, "last_step", attempt=1, step=16),
        _ev(138.0, "phase", attempt=1, phase="checkpointing", step=16),
        _ev(139.0, "phase", attempt=1, phase="training", step=16),
        _ev(141.0, "job_end", state="succeeded"),
    ]
    r = goodput(events)
    # The hang started at the last progress, 120 - 5 = 115 (entering the checkpoint), so detection and recovery is
    # 115..122 and takes that checkpoint's stall too; nothing lies between the resumed checkpoint (116) and the
    # fault, so no lost progress. Start-up: 100..101, 101..110 less the restore 103..104, 122..128 less the restore
    # 123..125 = 13. Shutdown: 138..141 less the final checkpoint's stall 138..139.
    assert r["badput_s"] == {"detection_recovery": 7.0, "lost_progress": 0.0, "restore": 3.0,
                             "checkpoint_stall": 1.0, "startup_compile": 13.0, "shutdown": 2.0}
    assert r["productive_s"] == 5.0 + 10.0 and r["wall_s"] == 41.0  # training 110..115 and 128..138
    assert r["productive_s"] + sum(r["badput_s"].values()) == pytest.approx(r["wall_s"])
    assert r["goodput"] == round(15.0 / 41.0, 4) and (r["attempts"], r["restarts"], r["lost_steps"]) == (2, 1, 2)


def test_goodput_lost_progress_since_the_resumed_checkpoint():
    events = [_ev(0.0, "job_start"), _ev(0.0, "start", attempt=0), _ev(2.0, "first_step", attempt=0, step=1),
              _ev(4.0, "phase", attempt=0, phase="checkpointing", step=4),
              _ev(4.5, "checkpoint", attempt=0, step=4, stall_s=0.5),
              _ev(4.5, "phase", attempt=0, phase="training", step=4),
              _ev(7.0, "crash", attempt=0, rank=0, fatal=True), _ev(7.5, "stopped", attempt=0),
              _ev(8.0, "start", attempt=1), _ev(9.0, "resumed", attempt=1, step=4, lost_steps=3),
              _ev(10.0, "first_step", attempt=1, step=5), _ev(12.0, "job_end")]
    r = goodput(events)
    assert r["badput_s"]["lost_progress"] == 2.5  # 4.5 .. 7.0
    assert r["badput_s"]["detection_recovery"] == 1.0  # 7.0 .. 8.0
    assert r["badput_s"]["startup_compile"] == 4.0  # 0..2 and 8..10
    assert r["badput_s"]["checkpoint_stall"] == 0.5 and r["productive_s"] == 2.0 + 2.0
    assert set(r["badput_s"]) == set(CATEGORIES)


def test_paint_gives_overlaps_to_the_higher_priority():
    totals = paint([(0, 10, "startup_compile"), (5, 8, "restore"), (7, 12, "detection_recovery")], 0, 20)
    assert totals["startup_compile"] == 5 and totals["restore"] == 2 and totals["detection_recovery"] == 5
    assert totals["productive"] == 8


# --------------------------------------------------------------------------------------------- heartbeats


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


def test_rejected_heartbeats_are_logged_and_change_nothing(tmp_path, write_tiny_config):
    """The launcher's own path: forged and malformed lines through a real server into the watchdog of a running
    job; each is logged to events.jsonl with its reason, and the machine's state is exactly what it was."""
    from angel_jax.tee.events import read_events
    from angel_jax.tol.launch import Launcher

    launcher = Launcher(write_tiny_config(tmp_path), [], workers=2)
    server = HeartbeatServer(launcher.token, 2).start()
    launcher.inbox = server.inbox
    try:
        d = Drive()
        d.wd = launcher.machine
        d.do(d.wd.start(time.monotonic()))
        d.warm(time.monotonic())
        d.all(time.monotonic(), 3)
        snapshot = (d.wd.state, d.wd.attempt, {r: (v.step, v.phase, v.last_progress, v.seq)
                                               for r, v in d.wd.ranks.items()})
        forged = [_body(kind="anomaly", detector="x", action="restart", anomaly_step=3, anomaly_rank=0,
                        message="forged", loss=None) | {"seq": 50}, _body(step=16, phase="done", seq=51)]
        for b in forged:
            b = {k: v for k, v in b.items() if k not in ("loss", "step_time", "times", "busy", "cache")
                 or b["kind"] == "heartbeat"}
            _send(server.address, encode("not-the-token", b))
        _send(server.address, b"{not json\n")
        _send(server.address, b"\x00\xff" * 10 + b"\n")
        items = _drain(server, until=lambda xs: len(xs) >= 4)
        for item in items:
            launcher._feed(item)
    finally:
        server.close()
        launcher.events.close()
    assert [x[0] for x in items] == ["rejected"] * 4
    rejected = list(read_events(launcher.run_dir / "events.jsonl", "heartbeat_rejected"))
    assert len(rejected) == 4 and all(e["source"] == "watchdog" and e["peer"].startswith("127.0.0.1:")
                                      for e in rejected)
    assert sorted(e["reason"].split(":")[0] for e in rejected) == ["malformed", "malformed", "unauthenticated",
                                                                    "unauthenticated"]
    assert (d.wd.state, d.wd.attempt, {r: (v.step, v.phase, v.last_progress, v.seq)
                                       for r, v in d.wd.ranks.items()}) == snapshot
    assert not d.wd.failures


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


# --------------------------------------------------------------------------------------------- worker env, config


def test_worker_env():
    env = {"ANGEL_JAX_COORDINATOR_ADDRESS": "127.0.0.1:5000", "ANGEL_JAX_NUM_PROCESSES": "2",
           "ANGEL_JAX_PROCESS_ID": "1", "ANGEL_JAX_ATTEMPT": "3", "ANGEL_JAX_NODE": "local2"}
    w = WorkerEnv.from_environ(env)
    assert (w.launched, w.num_processes, w.process_id, w.attempt, w.node) == (True, 2, 1, 3, "local2")
    assert not WorkerEnv.from_environ({}).launched
    with pytest.raises(ValueError, match="ANGEL_JAX_NUM_PROCESSES and ANGEL_JAX_PROCESS_ID"):
        WorkerEnv.from_environ({"ANGEL_JAX_COORDINATOR_ADDRESS": "h:1"})
    with pytest.raises(ValueError, match="ANGEL_JAX_ATTEMPT='x' is not an integer"):
        WorkerEnv.from_environ({"ANGEL_JAX_ATTEMPT": "x"})
    assert cluster_detected({"SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS": "2",
                             "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}) == "slurm"
    assert cluster_detected({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "0"}) == "kubernetes"
    assert cluster_detected({"HOME": "/"}) is None


def test_checkpoint_kill_point_scoped_to_an_attempt():
    assert ckpt_kill_for_attempt("snapshot.copy@8", 3) == "snapshot.copy@8"
    assert ckpt_kill_for_attempt("snapshot.copy@8:attempt=0", 0) == "snapshot.copy@8"
    assert ckpt_kill_for_attempt("snapshot.copy@8:attempt=0", 1) is None
    with pytest.raises(ValueError, match="expected <point>"):
        ckpt_kill_for_attempt("snapshot.copy@8:rank=0", 0)


@pytest.mark.parametrize("override, message", [
    ("resilience.hang_factor=0.5", "'resilience.hang_factor'.*must be >= 1"),
    ("resilience.stop_grace=-1", "'resilience.stop_grace'.*must be >= 0"),
    ("resilience.no_progress_limit=-1", "'resilience.no_progress_limit'.*must be >= 0"),
    ("resilience.heartbeat_lost_after=0.5", "'resilience.heartbeat_lost_after'.*longer than heartbeat_interval"),
    ("resilience.slow_phase_timeout=.inf", "'resilience.slow_phase_timeout'.*must be a finite number"),
    ("resilience.exclude_after=two", "'resilience.exclude_after'.*expected int"),
])
def test_resilience_config_validation(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_launch_refuses_a_bad_config_before_starting_anything(tmp_path):
    from angel_jax import cli

    bad = tmp_path / "bad.yaml"
    bad.write_text("resilience: {max_restarts: -1}\ntrain: {run_dir: " + str(tmp_path / "run") + "}\n")
    assert cli.main(["launch", "-n", "2", str(bad)]) == 2
    assert not (tmp_path / "run").exists()


def test_straggler_is_found_from_busy_times_not_step_times():
    """Synchronous data parallelism: both ranks report the same step time; rank 1's busy time (its time outside
    waiting for the device) is 3x: the straggler watch names rank 1 once 8 of its last 10 steps were slow."""
    from angel_jax.tee.actions import ActionPolicy, CrossRankSuite
    from angel_jax.tee.detectors import AnomalyConfig
    from angel_jax.tol.watchers import CrossRankWatch

    watch = CrossRankWatch(CrossRankSuite(AnomalyConfig(), ActionPolicy()))
    views = {r: co.RankView(rank=r, node=f"local{r}", pid=10 + r, spawned=0.0, last_progress=0.0) for r in (0, 1)}
    found = []
    for step in range(1, 13):
        for r, busy in ((0, 0.02), (1, 0.30)):
            views[r].step_times[step] = 0.31  # the same wall time on every rank
            views[r].busy_times[step] = busy
        found += watch.observe(float(step), views)
    assert [(a.detector, a.rank, a.step, a.action) for a in found] == [("straggler", 1, 8, "log")]
    quiet = CrossRankWatch(CrossRankSuite(AnomalyConfig(), ActionPolicy()))
    for r in (0, 1):
        views[r].busy_times = {s: 0.02 for s in range(1, 13)}
    assert quiet.observe(13.0, views) == []
