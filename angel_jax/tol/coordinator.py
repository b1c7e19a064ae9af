"""The watchdog's decisions (TRANSOM TOL), as a pure state machine: inputs in, actions out, no clock of its own.

    wd = Watchdog(WatchdogPolicy.from_config(cfg.resilience, total_steps=cfg.train.steps), n_workers=2)
    actions = wd.start(now)                       # [Emit("job_start"), Spawn(attempt=0, nodes=[...])]
    actions = wd.handle(GroupStarted(now, 0, {0: 4711, 1: 4712}))
    actions = wd.handle(Message(now, {...}))      # a verified heartbeat (heartbeat.py checks token and shape)
    actions = wd.handle(WorkerExited(now, 0, rank=1, returncode=-9))
    actions = wd.handle(Tick(now))                # time passes: hangs and lost heartbeats are judged here
    actions = wd.handle(GroupStopped(now, 0, {0: "...", 1: "..."}))

The launcher (launch.py) is the thin shell that carries the actions out (spawn, stop the group, write events) and
feeds back what happened; `now` is whatever monotonic clock it uses, so tests drive the machine with exact times.

States: starting (workers spawned, not all heard from) -> warmup (all connected; set-up, restore, compile) ->
running (steps complete) -> recovering (a failure: the group is stopped and restarted from the newest valid
checkpoint, until the first step after the restart completes) -> running, or -> failed (restart budget or
no-progress limit spent) ; succeeded when process 0 exits 0 after the last step.

Failures: a worker exits non-zero or dies by a signal; a hang (no step progress within the timeout: `hang_timeout`,
from observed step times with a safety factor, longer in phases that make no steps by nature); a fatal anomaly
(action restart or exclude) reported by a worker's detectors or by a coordinator-side detector. A crash whose
error says a collective broke (`collateral`) is held up to policy.crash_settle for the exit of the peer that broke
it, whichever order the exits reach the launcher in, so the failure is charged to the worker that caused it.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import signal
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence

from angel_jax.config import ResilienceConfig
from angel_jax.errors import EXIT_CONFIG, EXIT_EXCLUDE, EXIT_RESTART
from angel_jax.phases import BEFORE_FIRST_STEP, SLOW_PHASES, Phase

FATAL_ACTIONS = ("restart", "exclude")
STEP_TIME_SAMPLES = 256


class State(enum.StrEnum):
    STARTING = "starting"
    WARMUP = "warmup"
    RUNNING = "running"
    RECOVERING = "recovering"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


# --------------------------------------------------------------------------------------------- policy


@dataclass(frozen=True)
class WatchdogPolicy:
    total_steps: int
    hang_timeout_min: float = 60.0
    hang_factor: float = 10.0
    slow_phase_timeout: float = 1800.0
    heartbeat_lost_after: float = 10.0
    stop_grace: float = 10.0
    max_restarts: int = 5
    no_progress_limit: int = 2
    exclude_after: int = 2
    crash_settle: float = 5.0

    @classmethod
    def from_config(cls, cfg: ResilienceConfig, *, total_steps: int) -> WatchdogPolicy:
        return cls(total_steps=total_steps, hang_timeout_min=cfg.hang_timeout_min, hang_factor=cfg.hang_factor,
                   slow_phase_timeout=cfg.slow_phase_timeout, heartbeat_lost_after=cfg.heartbeat_lost_after,
                   stop_grace=cfg.stop_grace, max_restarts=cfg.max_restarts,
                   no_progress_limit=cfg.no_progress_limit, exclude_after=cfg.exclude_after,
                   crash_settle=cfg.crash_settle)


def p95(samples: Sequence[float]) -> float | None:
    """Nearest-rank 95th percentile (None for no samples)."""
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def hang_timeout(policy: WatchdogPolicy, step_times: Sequence[float], *, slow: bool) -> float:
    """Seconds without progress that make a hang: max(hang_timeout_min, hang_factor x p95 step time), and at least
    slow_phase_timeout while any worker is in a phase without steps (collectives couple the group: a worker
    waiting for a peer that is writing a checkpoint shows no progress either)."""
    base = policy.hang_timeout_min
    q = p95(step_times)
    if q is not None:
        base = max(base, policy.hang_factor * q)
    return max(base, policy.slow_phase_timeout) if slow else base


# What a worker's error says when the failure is another's: its collective broke because a peer died (gloo's TCP
# pairs, JAX's coordination service). Matched in lower case against the error the worker reported on its way out.
COLLATERAL_MARKERS = ("connection reset by peer", "connection closed by peer", "broken pipe", "gloo",
                      "coordination service", "socket closed")


def collateral(returncode: int, error: str) -> bool:
    """Whether an exit looks like the consequence of another worker's failure rather than a failure of its own:
    a collective that broke (the markers above), or SIGABRT (JAX aborts a process whose distributed service saw a
    peer die). The statuses a worker chose (restart, exclusion, config) and other signals are its own."""
    if returncode in (EXIT_RESTART, EXIT_EXCLUDE, EXIT_CONFIG):
        return False
    if returncode == -signal.SIGABRT:
        return True
    text = error.lower()
    return returncode > 0 and any(m in text for m in COLLATERAL_MARKERS)


def describe_status(returncode: int) -> str:
    """'was killed by SIGKILL', 'exited with status 1', 'exited with status 75 (restart requested)'."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    notes = {EXIT_RESTART: " (restart requested)", EXIT_EXCLUDE: " (exclusion of its node requested)",
             EXIT_CONFIG: " (the run cannot go on as configured)", 143: " (after SIGTERM)", 130: " (interrupted)"}
    return f"exited with status {returncode}{notes.get(returncode, '')}"


# --------------------------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class GroupStarted:
    now: float
    attempt: int
    pids: Mapping[int, int]
    """rank -> pid."""


@dataclass(frozen=True)
class Message:
    now: float
    body: Mapping[str, Any]
    """A verified message body (see heartbeat.py for the fields)."""


@dataclass(frozen=True)
class WorkerExited:
    now: float
    attempt: int
    rank: int
    returncode: int
    """Exit status, or -signal number."""


@dataclass(frozen=True)
class Tick:
    now: float


@dataclass(frozen=True)
class AnomalyReport:
    """A finding of a detector, in a worker (forwarded by its heartbeat client) or on the coordinator."""

    now: float
    detector: str
    action: str
    """log, skip, rollback, restart or exclude; only restart and exclude make the watchdog act."""
    rank: int | None
    step: int
    message: str
    source: str = "coordinator"


@dataclass(frozen=True)
class GroupStopped:
    now: float
    attempt: int
    outcomes: Mapping[int, str]
    """rank -> how it ended ('exited with status 1 before the stop', 'killed by SIGKILL after 10 s grace')."""


@dataclass(frozen=True)
class NodeDown:
    """The scheduler's daemon on `node` answers no more (under a scheduler: the machine is gone or cut off)."""

    now: float
    node: str


Input = GroupStarted | Message | WorkerExited | Tick | AnomalyReport | GroupStopped | NodeDown


# --------------------------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class Spawn:
    attempt: int
    nodes: tuple[str, ...]
    """nodes[rank]: where each rank runs."""
    resume: bool
    """Restarts always resume from the newest valid checkpoint."""


@dataclass(frozen=True)
class StopGroup:
    attempt: int
    reason: str
    grace: float


@dataclass(frozen=True)
class Emit:
    kind: str
    fields: dict[str, Any]


@dataclass(frozen=True)
class Finish:
    state: State
    summary: str


Action = Spawn | StopGroup | Emit | Finish


class CoordinatorDetector(Protocol):
    """A coordinator-side detector (e.g. cross-rank stragglers): reads the ranks' view on every tick and reports
    anomalies; those with action restart or exclude make the watchdog recover."""

    def observe(self, now: float, ranks: Mapping[int, RankView]) -> list[AnomalyReport]: ...


# --------------------------------------------------------------------------------------------- state


@dataclass
class RankView:
    """What the coordinator knows about one rank of the current attempt."""

    rank: int
    node: str
    pid: int | None
    spawned: float
    last_progress: float
    """When the step or the phase last changed (or the spawn)."""
    last_seen: float | None = None
    step: int | None = None
    """Last completed step reported (lower again after a rollback)."""
    high: int | None = None
    """The highest step this rank reached in this attempt."""
    start_step: int | None = None
    """The step this attempt started from (the restored checkpoint), once reported."""
    phase: Phase = Phase.STARTING
    loss: float | None = None
    step_time: float | None = None
    seq: int = -1
    lost: bool = False
    exited: int | None = None
    error: str = ""
    step_times: dict[int, float] = field(default_factory=dict)
    """step -> step time, the most recent ones (for cross-rank detectors)."""
    busy_times: dict[int, float] = field(default_factory=dict)
    """step -> time outside waiting for the device (the straggler detector's figure)."""
    cache: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Failure:
    kind: str
    """crash, hang, node_lost or anomaly."""
    attempt: int
    rank: int | None
    node: str | None
    step: int | None
    phase: Phase
    detail: str
    """One line naming the worker, its exit status or signal, the step and phase."""
    action: str = "restart"
    """restart, exclude (restart without the node), an anomaly's action, or fail (no restart: EXIT_CONFIG)."""

    def line(self) -> str:
        return f"attempt {self.attempt}: {self.detail}"


class Watchdog:
    """The state machine. `handle` never blocks and reads no clock; every decision is an Action."""

    def __init__(self, policy: WatchdogPolicy, *, n_workers: int, spares: int = 0, resume: bool = True,
                 node_names: Sequence[str] | None = None, ranks_per_node: int = 1):
        if n_workers < 1 or ranks_per_node < 1 or n_workers % ranks_per_node:
            raise ValueError(f"{n_workers} workers do not fill nodes of {ranks_per_node} ranks")
        self.policy = policy
        self.n = n_workers
        self.per_node = ranks_per_node
        self.nodes = list(node_names) if node_names else [f"local{i}" for i in range(n_workers + spares)]
        if len(self.nodes) * ranks_per_node < n_workers:
            raise ValueError(f"{len(self.nodes)} nodes for {n_workers} workers at {ranks_per_node} per node")
        self.assignment = [self.nodes[r // ranks_per_node] for r in range(n_workers)]
        """assignment[rank]: the node it runs on (ranks_per_node consecutive ranks per node)."""
        self.excluded: list[str] = []
        self.node_failures: dict[str, int] = {}
        self.first_resume = resume
        self.state = State.STARTING
        self.attempt = 0
        self.restarts = 0
        self.no_progress = 0
        self.best_step = -1
        """The highest step any attempt reached."""
        self.failures: list[Failure] = []
        self.ranks: dict[int, RankView] = {}
        self.step_times: deque[float] = deque(maxlen=STEP_TIME_SAMPLES)
        self.stopping = False
        self.rank0_done = False
        self.finishing_since: float | None = None
        self.started_at: float | None = None
        self.detected_at: float | None = None
        self.fault_at: float | None = None
        self.stopped_at: float | None = None
        self.phase_at: dict[str, float] = {}
        """Rank 0's phase -> when it entered it, this attempt (for the recovery breakdown)."""
        self.attempt_first_step: float | None = None
        self.last_step_seen = False
        self.settling: list[tuple[Failure, float]] = []
        """This attempt's crashes that look like the consequence of another's (`collateral`), with their exit
        times: held up to policy.crash_settle for the exit of the worker that caused them."""
        self.prev_attempt_best: int | None = None

    # --------------------------------------------------------------------------------------------- entry points

    def start(self, now: float) -> list[Action]:
        self.started_at = now
        return [Emit("job_start", {"workers": self.n, "nodes": list(self.nodes), "steps": self.policy.total_steps,
                                   "policy": dataclasses.asdict(self.policy)}),
                Spawn(0, tuple(self.assignment), self.first_resume)]

    def handle(self, event: Input) -> list[Action]:
        if self.state in (State.SUCCEEDED, State.FAILED):
            return []
        if isinstance(event, GroupStarted):
            return self._started(event)
        if isinstance(event, Message):
            return self._message(event)
        if isinstance(event, WorkerExited):
            return self._exited(event)
        if isinstance(event, Tick):
            return self._tick(event.now)
        if isinstance(event, AnomalyReport):
            return self._anomaly(event)
        if isinstance(event, GroupStopped):
            return self._stopped(event)
        if isinstance(event, NodeDown):
            return self._node_down(event)
        raise TypeError(f"unknown watchdog input {event!r}")

    @property
    def live(self) -> list[RankView]:
        return [r for r in self.ranks.values() if r.exited is None]

    # --------------------------------------------------------------------------------------------- transitions

    def _to(self, state: State, reason: str) -> list[Action]:
        if state == self.state:
            return []
        old, self.state = self.state, state
        return [Emit("state", {"from": old.value, "to": state.value, "attempt": self.attempt, "reason": reason})]

    def _started(self, e: GroupStarted) -> list[Action]:
        if e.attempt != self.attempt:
            return []
        self.ranks = {r: RankView(r, self.assignment[r], e.pids.get(r), e.now, e.now) for r in range(self.n)}
        self.stopping, self.rank0_done, self.finishing_since = False, False, None
        self.phase_at, self.attempt_first_step, self.last_step_seen = {}, None, False
        self.settling = []
        return [Emit("start", {"attempt": self.attempt, "workers": [
            {"rank": r, "node": v.node, "pid": v.pid} for r, v in self.ranks.items()]})]

    def _message(self, e: Message) -> list[Action]:
        body = e.body
        view = self.ranks.get(body["rank"])
        if body["attempt"] != self.attempt or view is None or self.stopping or body["seq"] <= view.seq:
            return []  # the previous group's last words, or reordered: nothing to learn
        view.seq = body["seq"]
        out: list[Action] = []
        if view.lost:
            view.lost = False
            out.append(Emit("heartbeat_resumed", {"rank": view.rank, "attempt": self.attempt,
                                                  "silent_s": round(e.now - (view.last_seen or view.spawned), 3)}))
        first_contact = view.last_seen is None
        view.last_seen = e.now
        view.pid = body.get("pid", view.pid)
        if isinstance(body.get("cache"), Mapping):
            view.cache = dict(body["cache"])
        kind = body["kind"]
        if kind == "exit":
            view.error = body.get("error", "")
        elif kind == "checkpoint" and view.rank == 0:
            out.append(Emit("checkpoint", {"attempt": self.attempt, "step": body["ckpt_step"],
                                           "stall_s": body["stall_s"]}))
        elif kind == "anomaly":
            return out + self._anomaly(AnomalyReport(e.now, body["detector"], body["action"],
                                                     body.get("anomaly_rank", view.rank), body["anomaly_step"],
                                                     body["message"], source=f"rank{view.rank}"))
        out += self._progress(view, e.now, body["step"], Phase(body["phase"]), body)
        if first_contact and self.state == State.STARTING and all(v.last_seen is not None for v in self.ranks.values()):
            out += self._to(State.WARMUP, "every worker reported")
        return out

    def _progress(self, view: RankView, now: float, step: int, phase: Phase, body: Mapping[str, Any]) -> list[Action]:
        out: list[Action] = []
        if view.start_step is None and phase not in BEFORE_FIRST_STEP:
            view.start_step = step
            if view.rank == 0 and (self.attempt > 0 or step > 0):
                lost = None if self.prev_attempt_best is None else max(0, self.prev_attempt_best - step)
                out.append(Emit("resumed", {"attempt": self.attempt, "step": step, "lost_steps": lost}))
        if phase != view.phase:
            view.phase, view.last_progress = phase, now
            if view.rank == 0:
                self.phase_at.setdefault(phase, now)
                out.append(Emit("phase", {"attempt": self.attempt, "phase": phase, "step": step}))
        if step != view.step:  # a rollback re-runs steps: progress too
            view.step, view.last_progress = step, now
            view.high = step if view.high is None else max(view.high, step)
            if view.start_step is not None and step > view.start_step:
                out += self._step_done(view, now, step)
        for s, t in body.get("times", ()):
            view.step_times[s] = t
            self.step_times.append(t)
        for s, b in body.get("busy", ()):
            view.busy_times[s] = b
        for times in (view.step_times, view.busy_times):
            while len(times) > STEP_TIME_SAMPLES:
                times.pop(min(times))
        view.loss = body.get("loss", view.loss)
        view.step_time = body.get("step_time", view.step_time)
        return out

    def _step_done(self, view: RankView, now: float, step: int) -> list[Action]:
        out: list[Action] = []
        if self.attempt_first_step is None:
            self.attempt_first_step = now
            out.append(Emit("first_step", {"attempt": self.attempt, "step": step, "rank": view.rank,
                                           "since_start_s": round(now - view.spawned, 3),
                                           "compile_cache": {str(v.rank): v.cache for v in self.ranks.values()}}))
            if self.state == State.RECOVERING:
                out.append(Emit("recovered", {"attempt": self.attempt, "step": step, **self._breakdown(now)}))
            out += self._to(State.RUNNING, f"step {step} completed")
        if step >= self.policy.total_steps and not self.last_step_seen:
            self.last_step_seen = True
            out.append(Emit("last_step", {"attempt": self.attempt, "step": step}))
        return out

    def _breakdown(self, now: float) -> dict[str, float | None]:
        """Where the time from the fault to the first step after the restart went."""
        def span(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else round(b - a, 3)

        restoring, compiling = self.phase_at.get(Phase.RESTORING), self.phase_at.get(Phase.COMPILING)
        start = self.ranks[0].spawned if self.ranks else None
        return {"detection_s": span(self.fault_at, self.detected_at),
                "teardown_s": span(self.detected_at, self.stopped_at),
                "restart_s": span(self.stopped_at, restoring or compiling), "restore_s": span(restoring, compiling),
                "compile_s": span(compiling, now), "spawn_s": span(self.stopped_at, start),
                "total_s": span(self.fault_at, now)}

    def _exited(self, e: WorkerExited) -> list[Action]:
        view = self.ranks.get(e.rank)
        if e.attempt != self.attempt or view is None or view.exited is not None:
            return []
        view.exited = e.returncode
        out: list[Action] = [Emit("exit", {"attempt": self.attempt, "rank": e.rank, "node": view.node,
                                           "pid": view.pid, "returncode": e.returncode,
                                           "status": describe_status(e.returncode), "step": view.step})]
        if self.stopping:
            return out
        if e.returncode == 0:
            if e.rank == 0:
                self.rank0_done = True  # train() returned on process 0: every step done, last checkpoint committed
                self.finishing_since = e.now
        elif self.rank0_done:
            out.append(Emit("exit_after_done", {"rank": e.rank, "status": describe_status(e.returncode)}))
        else:
            failure = Failure(
                "crash", self.attempt, e.rank, view.node, view.step, view.phase,
                f"rank {e.rank} (node {view.node}, pid {view.pid}) {describe_status(e.returncode)} at step "
                f"{_step_text(view.step)} in phase {view.phase}" + (f": {view.error}" if view.error else ""),
                action={EXIT_EXCLUDE: "exclude", EXIT_CONFIG: "fail"}.get(e.returncode, "restart"))
            if not (self.policy.crash_settle > 0 and collateral(e.returncode, view.error)):
                # its own failure: charged at once, also when a peer's broken collective was seen first
                held = [f.rank for f, _ in self.settling]
                fault_at = min([at for _, at in self.settling] + [e.now])
                return out + self._fail(fault_at, e.now, failure, extra={"after_peers": held} if held else None)
            self.settling.append((failure, e.now))
            if len(self.settling) == 1:
                out.append(Emit("crash_settling", {
                    "attempt": self.attempt, "rank": e.rank, "node": view.node, "status": describe_status(e.returncode),
                    "wait_s": self.policy.crash_settle,
                    "message": f"rank {e.rank} {describe_status(e.returncode)} on what looks like a peer's failure "
                               f"({view.error or 'an abort'}); waiting up to {self.policy.crash_settle:g} s for "
                               "the exit of the worker that caused it"}))
        if not self.live:
            if self.settling:  # nobody left whose exit could name the cause
                return out + self._settle(e.now)
            return out + self._finish(State.SUCCEEDED, self._success_summary())
        return out

    def _settle(self, now: float) -> list[Action]:
        """No worker's own failure turned up within the window: the first crash held is charged."""
        failure, at = self.settling[0]
        return self._fail(at, now, failure, extra={"settled_s": round(now - at, 3)})

    def _anomaly(self, e: AnomalyReport) -> list[Action]:
        fields = {"attempt": self.attempt, "detector": e.detector, "action": e.action, "rank": e.rank,
                  "step": e.step, "message": e.message, "source": e.source}
        if e.action not in FATAL_ACTIONS or self.stopping:
            return [Emit("anomaly", {**fields, "taken": "logged"})]
        view = self.ranks.get(e.rank) if e.rank is not None else None
        where = f"rank {e.rank} (node {view.node})" if view is not None else "the group"
        return self._fail(e.now, e.now, Failure(
            "anomaly", self.attempt, e.rank, view.node if view else None, e.step,
            view.phase if view else Phase.TRAINING,
            f"{e.detector} on {where} at step {e.step} asked for {e.action}: {e.message}", action=e.action),
            extra=fields)

    def _tick(self, now: float) -> list[Action]:
        if self.stopping or not self.ranks:
            return []
        if self.settling and now - self.settling[0][1] >= self.policy.crash_settle:
            return self._settle(now)
        out: list[Action] = []
        for view in self.live:
            if view.last_seen is None:
                continue  # not connected yet: starting up is judged by the hang timeout of its phase
            silent = now - view.last_seen
            if not view.lost and silent > self.policy.heartbeat_lost_after:
                view.lost = True
                out.append(Emit("heartbeat_lost", {"attempt": self.attempt, "rank": view.rank, "node": view.node,
                                                   "silent_s": round(silent, 3), "step": view.step,
                                                   "phase": view.phase}))
        if self.finishing_since is not None and now - self.finishing_since > self.policy.stop_grace:
            names = ", ".join(f"rank {v.rank}" for v in self.live)
            self.stopping = True
            return out + [Emit("stopping", {"attempt": self.attempt, "reason": f"{names} still running "
                                            f"{self.policy.stop_grace:g} s after process 0 finished"}),
                          StopGroup(self.attempt, "finished", self.policy.stop_grace)]
        timeout = self.current_timeout()
        hung = [v for v in self.live if now - v.last_progress > timeout]
        if hung:
            # A stopped process sends nothing; a process blocked in a collective keeps its heartbeat thread
            # talking: the silent one is the culprit, else the one that progressed least recently.
            suspect = min(hung, key=lambda v: (not v.lost, v.last_progress))
            silent_for = now - suspect.last_progress
            detail = (f"rank {suspect.rank} (node {suspect.node}, pid {suspect.pid}) made no progress for "
                      f"{silent_for:.1f} s (timeout {timeout:.1f} s) at step {_step_text(suspect.step)} in phase "
                      f"{suspect.phase}" + ("; its heartbeats stopped" if suspect.lost else ""))
            out += self._fail(suspect.last_progress, now, Failure(
                "hang", self.attempt, suspect.rank, suspect.node, suspect.step, suspect.phase, detail),
                extra={"timeout_s": round(timeout, 3), "silent_s": round(silent_for, 3),
                       "heartbeat_lost": suspect.lost})
        return out

    def _node_down(self, e: NodeDown) -> list[Action]:
        """A node whose daemon is gone: excluded at once. Its ranks' peers usually fail first (a broken
        collective); such a failure of this attempt is charged to the lost node instead."""
        if e.node in self.excluded:
            return []
        if e.node not in self.assignment:  # a spare: no longer one
            self.excluded.append(e.node)
            return [Emit("exclusion", {"node": e.node, "rank": None, "failures": 0, "reason": "spare node lost",
                                       "replaced_by": None})]
        views = [v for v in self.ranks.values() if self.assignment[v.rank] == e.node]
        first = views[0] if views else None
        detail = (f"node {e.node} lost: its slurmd answers no connection"
                  + (f" (ranks {', '.join(str(v.rank) for v in views)})" if views else ""))
        failure = Failure("node_lost", self.attempt, first.rank if first else None, e.node,
                          first.step if first else None, first.phase if first else Phase.STARTING, detail,
                          action="exclude")
        if not self.stopping:
            return self._fail(e.now, e.now, failure)
        blamed = self.failures[-1] if self.failures and self.failures[-1].attempt == self.attempt else None
        if blamed is not None and blamed.kind == "node_lost" and blamed.node == e.node:
            return []  # its heartbeats told us first
        if blamed is not None and blamed.node not in (None, e.node):
            self.node_failures[blamed.node] -= 1  # the peer of a lost node: not its own fault
        self.failures.append(failure)
        if blamed is None or blamed.node != e.node:  # a crash of its own rank already counted this failure
            self.node_failures[e.node] = self.node_failures.get(e.node, 0) + 1
        return [Emit("node_lost", {"attempt": self.attempt, "node": e.node, "rank": failure.rank,
                                   "message": detail, "recharged_from": blamed.node if blamed else None})]

    @property
    def lost_ranks(self) -> list[int]:
        """The ranks of this attempt on a node found lost: nothing of theirs can stop gracefully or save (their
        job steps are stopped at once, not after the grace)."""
        lost = {f.node for f in self.failures if f.kind == "node_lost" and f.attempt == self.attempt}
        return [r for r, node in enumerate(self.assignment) if node in lost]

    def current_timeout(self) -> float:
        slow = any(v.phase in SLOW_PHASES or (v.step or 0) >= self.policy.total_steps for v in self.live)
        return hang_timeout(self.policy, list(self.step_times), slow=slow)

    def _fail(self, fault_at: float, now: float, failure: Failure, extra: dict | None = None) -> list[Action]:
        self.settling = []
        self.failures.append(failure)
        if failure.node is not None:
            self.node_failures[failure.node] = self.node_failures.get(failure.node, 0) + 1
        self.stopping = True
        self.fault_at, self.detected_at = fault_at, now
        fields = {**(extra or {}), "attempt": self.attempt, "rank": failure.rank, "node": failure.node,
                  "step": failure.step, "phase": failure.phase, "message": failure.detail, "fatal": True}
        if failure.kind == "crash":
            view = self.ranks[failure.rank]
            fields.update(returncode=view.exited, status=describe_status(view.exited), pid=view.pid)
        out: list[Action] = [Emit(failure.kind, fields)]
        out += self._to(State.RECOVERING, failure.detail)
        out.append(Emit("stopping", {"attempt": self.attempt, "reason": failure.detail}))
        return out + [StopGroup(self.attempt, failure.detail, self.policy.stop_grace)]

    def _stopped(self, e: GroupStopped) -> list[Action]:
        if e.attempt != self.attempt:
            return []
        self.stopped_at = e.now
        outcomes = {str(k): v for k, v in e.outcomes.items()}
        out: list[Action] = [Emit("stopped", {"attempt": self.attempt, "outcomes": outcomes,
                                              "teardown_s": round(e.now - (self.detected_at or e.now), 3)})]
        if self.rank0_done:
            return out + self._finish(State.SUCCEEDED, self._success_summary())
        reached = self._reached()
        started = self.ranks[0].start_step if self.ranks else None
        progressed = reached > max(self.best_step, started if started is not None else -1)
        self.no_progress = 0 if progressed else self.no_progress + 1
        self.best_step = max(self.best_step, reached)
        self.prev_attempt_best = reached if reached >= 0 else None
        last = self.failures[-1]
        p = self.policy
        if last.action == "fail":  # a config the run refuses: every restart would fail the same way
            return out + self._finish(State.FAILED, self._failed_summary(
                f"rank {last.rank} cannot go on as configured, which no restart mends (fix the config, or the "
                "checkpoint it resumes)"))
        if self.restarts >= p.max_restarts:
            return out + self._finish(State.FAILED, self._failed_summary(
                f"the restart budget is spent (resilience.max_restarts={p.max_restarts})"))
        if p.no_progress_limit and self.no_progress >= p.no_progress_limit:
            return out + self._finish(State.FAILED, self._failed_summary(
                f"{self.no_progress} attempt(s) in a row got no step past step {self.best_step} "
                f"(resilience.no_progress_limit={p.no_progress_limit})"))
        out += self._maybe_exclude(last)
        self.restarts += 1
        self.attempt += 1
        out.append(Emit("restart", {"attempt": self.attempt, "restarts": self.restarts, "budget": p.max_restarts,
                                    "nodes": list(self.assignment), "after": last.detail}))
        return out + [Spawn(self.attempt, tuple(self.assignment), True)]

    def _maybe_exclude(self, failure: Failure) -> list[Action]:
        node = failure.node
        if node is None or failure.rank is None:
            return []
        count = self.node_failures.get(node, 0)
        wanted = failure.action == "exclude" or (self.policy.exclude_after and count >= self.policy.exclude_after)
        if not wanted:
            return []
        spares = [n for n in self.nodes if n not in self.assignment and n not in self.excluded]
        why = ("node lost" if failure.kind == "node_lost" else
               "exclusion requested" if failure.action == "exclude" else f"{count} failures")
        if not spares:
            return [Emit("exclusion_skipped", {"node": node, "rank": failure.rank, "failures": count,
                                               "reason": f"{why}, but no spare node is left (launch --spares)"})]
        self.excluded.append(node)
        self.assignment = [spares[0] if n == node else n for n in self.assignment]  # every rank of the node
        return [Emit("exclusion", {"node": node, "rank": failure.rank, "failures": count, "reason": why,
                                   "replaced_by": spares[0]})]

    # --------------------------------------------------------------------------------------------- the end

    def _finish(self, state: State, summary: str) -> list[Action]:
        out = self._to(state, summary)
        return out + [Emit("job_end", {"state": state.value, "summary": summary, "attempts": self.attempt + 1,
                                       "restarts": self.restarts, "best_step": max(self.best_step, self._reached()),
                                       "failures": [f.line() for f in self.failures],
                                       "excluded": list(self.excluded)}),
                      Finish(state, summary)]

    def _reached(self) -> int:
        return max((v.high for v in self.ranks.values() if v.high is not None), default=-1)

    def _success_summary(self) -> str:
        text = f"all {self.policy.total_steps} steps done in {self.attempt + 1} attempt(s), {self.restarts} restart(s)"
        if self.failures:
            text += "; recovered from: " + "; ".join(f.line() for f in self.failures)
        return text

    def _failed_summary(self, why: str) -> str:
        last = self.failures[-1]
        return (f"job failed after {self.restarts} restart(s): {why}. Last failure: {last.detail}. "
                f"All failures: " + "; ".join(f.line() for f in self.failures))


def _step_text(step: int | None) -> str:
    return "?" if step is None else str(step)
