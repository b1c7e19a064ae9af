"""The launcher (launch.py) without worker processes: forged and malformed heartbeats through a real server into
the watchdog of a running job, and a bad config refused before anything starts. Real processes and real faults
are in test_watchdog_faults.py and test_watchdog_recovery.py.
"""

from __future__ import annotations

import time

from angel_jax.tol.heartbeat import HeartbeatServer, encode
from test_tol_heartbeat import _body, _drain, _send
from tol_drive import Drive


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


def test_launch_refuses_a_bad_config_before_starting_anything(tmp_path):
    from angel_jax import cli

    bad = tmp_path / "bad.yaml"
    bad.write_text("resilience: {max_restarts: -1}\ntrain: {run_dir: " + str(tmp_path / "run") + "}\n")
    assert cli.main(["launch", "-n", "2", str(bad)]) == 2
    assert not (tmp_path / "run").exists()


def test_the_ranks_of_a_lost_node_are_killed_at_once_and_the_others_stopped_gracefully(tmp_path):
    """WorkerGroup.stop(at_once=...): a rank on a lost node cannot save; it is killed first, and the stop waits for
    the others' SIGTERM alone (rank 1 ignores SIGTERM: only a SIGKILL ends it; rank 0 saves on SIGTERM)."""
    import signal
    import sys

    from angel_jax.tol.group import WorkerGroup

    group = WorkerGroup(0, tmp_path, on_exit=lambda *a: None)
    script = ("import signal, sys, time; signal.signal(signal.SIGTERM, {}); print('up', flush=True); "
              "time.sleep(600)")
    graceful = script.format("lambda *a: sys.exit(143)")
    stubborn = script.format("signal.SIG_IGN")
    group.spawn({0: ([sys.executable, "-c", graceful], {}), 1: ([sys.executable, "-c", stubborn], {})})
    for rank in (0, 1):
        while "up" not in (tmp_path / f"attempt0-rank{rank}.log").read_text():
            time.sleep(0.02)
    outcomes = group.stop(grace=30, at_once=[1])
    assert outcomes == {0: "exited with status 143 after SIGTERM", 1: "killed by SIGKILL at once (its node was lost)"}
    assert group.workers[1].proc.returncode == -signal.SIGKILL
