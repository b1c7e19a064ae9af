"""The watchdog's state machine (coordinator.py) with exact values, driven with an injected clock: states, crashes,
hangs and their timeouts, heartbeat loss, restart budgets, exclusions, anomalies, stale messages. Real processes
and real faults are in test_watchdog_faults.py and test_watchdog_recovery.py.
"""

from __future__ import annotations

from angel_jax.tol import coordinator as co
from tol_drive import POLICY, Drive


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


def test_a_run_that_cannot_go_on_as_configured_fails_without_a_restart():
    """A worker that exits with EXIT_CONFIG (the engine refused the config, or the checkpoint does not fit it) fails
    the job at once, with restarts left in the budget: each restart would fail the same way."""
    d = Drive()
    d.started(0.0)
    d.all(0.5, 0, "setup")
    d.msg(1.0, 0, 0, "restoring")
    d.exit(2.0, 0, co.EXIT_CONFIG)
    (crash,) = d.events("crash")
    assert crash["status"] == "exited with status 78 (the run cannot go on as configured)"
    d.exit(2.1, 1, -15)
    d.stopped(3.0)
    assert d.wd.state == co.State.FAILED and d.wd.restarts == 0 and len(d.of(co.Spawn)) == 1
    (finish,) = d.of(co.Finish)
    assert finish.summary.startswith("job failed after 0 restart(s): rank 0 cannot go on as configured, which no "
                                     "restart mends (fix the config, or the checkpoint it resumes). Last failure: "
                                     "rank 0 (node local0, pid 100) exited with status 78")


def test_a_worker_exits_with_the_status_its_failure_calls_for():
    from angel_jax.config import ConfigError
    from angel_jax.tol.worker import exit_status
    from angel_jax.train.protocol import StateMismatch

    assert exit_status(ConfigError("'mesh': ...")) == exit_status(StateMismatch("another model")) == co.EXIT_CONFIG
    assert exit_status(RuntimeError("a broken collective")) == 1 and exit_status(KeyboardInterrupt()) == 130


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
    assert co.EXIT_RESTART == 75 and co.EXIT_EXCLUDE == 76 and co.EXIT_CONFIG == 78
    from angel_jax import errors

    assert (errors.EXIT_RESTART, errors.EXIT_EXCLUDE, errors.EXIT_CONFIG) == (co.EXIT_RESTART, co.EXIT_EXCLUDE,
                                                                               co.EXIT_CONFIG)


GLOO = ("JaxRuntimeError: UNKNOWN: Gloo AllGather failed: [gloo/transport/tcp/pair.cc:538] Read error "
        "[127.0.0.1]:10906: Connection reset by peer")


def test_the_peer_whose_collective_broke_first_is_not_charged_when_the_culprit_exits_within_the_window():
    """Rank 1 is SIGKILLed, but rank 0's exit (its all-gather broke) reaches the launcher first: rank 0's crash is
    held, and rank 1's exit, 0.8 s later, is the one charged, with the fault time of the first exit."""
    d = Drive(node_names=["n1", "n2", "n3"])
    d.warm(0.0)
    d.all(3.0, 2)
    d.msg(4.0, 0, 2, kind="exit", code=1, error=GLOO)
    d.exit(4.1, 0, 1)
    assert d.events("crash") == [] and not d.of(co.StopGroup) and d.wd.state == co.State.RUNNING
    (held,) = d.events("crash_settling")
    assert (held["rank"], held["node"], held["status"], held["wait_s"]) == (0, "n1", "exited with status 1", 4.0)
    assert not [a for a in d.tick(8.0) if not isinstance(a, co.Emit)]  # 3.9 s: still in the window
    d.exit(4.9, 1, -9)
    (crash,) = d.events("crash")
    assert (crash["rank"], crash["node"], crash["status"], crash["after_peers"]) == (1, "n2", "was killed by SIGKILL",
                                                                                     [0])
    assert d.wd.node_failures == {"n2": 1} and d.wd.fault_at == 4.1 and d.wd.detected_at == 4.9
    assert len(d.of(co.StopGroup)) == 1
    d.exit(5.0, 0, 1)  # already exited: nothing more
    assert len(d.wd.failures) == 1


def test_a_crash_held_as_a_consequence_is_charged_when_no_culprit_turns_up():
    d = Drive()
    d.warm(0.0)
    d.all(3.0, 2)
    d.msg(4.0, 0, 2, kind="exit", code=1, error=GLOO)
    d.exit(4.0, 0, 1)
    assert not [a for a in d.tick(7.9) if not isinstance(a, co.Emit)]
    d.tick(8.0)  # the window (crash_settle 4 s) is over: rank 0 is charged
    (crash,) = d.events("crash")
    assert (crash["rank"], crash["status"], crash["settled_s"]) == (0, "exited with status 1", 4.0)
    assert crash["message"] == f"rank 0 (node local0, pid 100) exited with status 1 at step 2 in phase training: {GLOO}"
    assert d.wd.fault_at == 4.0 and d.wd.detected_at == 8.0 and d.wd.state == co.State.RECOVERING
    # every worker gone, all of them on a broken collective: the first is charged at once
    d = Drive(n=3)
    d.warm(0.0)
    d.all(3.0, 2)
    for t, rank in ((4.0, 2), (4.2, 0), (4.3, 1)):
        d.msg(t, rank, 2, kind="exit", code=1, error=GLOO)
        d.exit(t, rank, 1 if rank else -6)  # an abort (JAX's distributed service) is a consequence too
    (crash,) = d.events("crash")
    assert (crash["rank"], crash["settled_s"]) == (2, 0.3) and len(d.events("crash_settling")) == 1


def test_what_counts_as_the_consequence_of_a_peer_failure():
    assert co.collateral(1, GLOO) and co.collateral(1, "ConnectionResetError: [Errno 104] Connection reset by peer")
    assert co.collateral(-6, "")  # SIGABRT: JAX aborts a process whose peer died
    assert not co.collateral(1, "InjectedFault: injected fault: raise@7")
    assert not co.collateral(1, "")  # no error reported: its own
    assert not co.collateral(-9, GLOO) and not co.collateral(-11, "")
    assert not co.collateral(co.EXIT_EXCLUDE, GLOO) and not co.collateral(co.EXIT_CONFIG, GLOO)
    # crash_settle 0: the first exit is charged, as it comes
    d = Drive(co.WatchdogPolicy(**{**vars(POLICY), "crash_settle": 0.0}))
    d.warm(0.0)
    d.msg(4.0, 0, 0, kind="exit", code=1, error=GLOO)
    d.exit(4.0, 0, 1)
    assert d.events("crash")[0]["rank"] == 0 and not d.events("crash_settling")


def test_a_lost_node_takes_the_blame_from_the_peer_whose_collective_broke():
    """Under a scheduler: rank 1's node vanishes, rank 0 fails first on the broken collective; the node probe
    says n2's daemon is gone, so n2 (not n1) is charged and excluded at once, the spare taking its rank."""
    d = Drive(node_names=["n1", "n2", "n3"])
    assert d.of(co.Spawn) == [co.Spawn(0, ("n1", "n2"), True)]
    d.warm(0.0)
    d.all(3.0, 1)
    d.exit(4.0, 0, 1)
    assert d.events("crash")[0]["node"] == "n1" and d.wd.node_failures == {"n1": 1}
    assert d.wd.lost_ranks == []
    d.do(d.wd.handle(co.NodeDown(4.5, "n2")))
    (lost,) = d.events("node_lost")
    assert (lost["node"], lost["rank"], lost["recharged_from"]) == ("n2", 1, "n1")
    assert d.wd.lost_ranks == [1]
    assert d.wd.node_failures == {"n1": 0, "n2": 1}
    d.stopped(5.0)
    assert d.events("exclusion") == [{"node": "n2", "rank": 1, "failures": 1, "reason": "node lost",
                                      "replaced_by": "n3"}]
    assert d.of(co.Spawn)[-1] == co.Spawn(1, ("n1", "n3"), True)
    d.do(d.wd.handle(co.NodeDown(6.0, "n2")))  # told again: already excluded, nothing more
    assert len(d.events("node_lost")) == 1


def test_a_node_lost_while_running_fails_the_attempt_and_all_its_ranks_move():
    d = Drive(n=4, node_names=["a", "b", "c"], ranks_per_node=2)
    assert d.of(co.Spawn) == [co.Spawn(0, ("a", "a", "b", "b"), True)]
    d.warm(0.0)
    d.all(3.0, 1)
    d.do(d.wd.handle(co.NodeDown(3.5, "b")))
    (failure,) = d.wd.failures
    assert (failure.kind, failure.node, failure.rank, failure.action) == ("node_lost", "b", 2, "exclude")
    assert failure.detail == "node b lost: its slurmd answers no connection (ranks 2, 3)"
    assert d.wd.state == co.State.RECOVERING and d.of(co.StopGroup)
    assert d.wd.lost_ranks == [2, 3]  # (their job steps are stopped at once: nothing of theirs can save)
    d.do(d.wd.handle(co.GroupStopped(4.0, 0, {r: "x" for r in range(4)})))
    assert d.of(co.Spawn)[-1] == co.Spawn(1, ("a", "a", "c", "c"), True)
    d.do(d.wd.handle(co.NodeDown(5.0, "c")))  # now no spare is left: the loss is a failure, not an exclusion
    assert d.events("exclusion_skipped")[-1:] == [] and d.wd.failures[-1].node == "c"


def test_a_lost_node_whose_own_rank_was_charged_first_counts_once():
    d = Drive(node_names=["n1", "n2", "n3"])
    d.warm(0.0)
    d.all(3.0, 1)
    d.exit(4.0, 1, -9)  # srun reports n2's rank gone before the probe finds its daemon dead
    d.do(d.wd.handle(co.NodeDown(4.5, "n2")))
    assert d.wd.node_failures == {"n2": 1} and d.events("node_lost")[0]["recharged_from"] == "n2"
    d.stopped(5.0)
    assert d.of(co.Spawn)[-1] == co.Spawn(1, ("n1", "n3"), True)
