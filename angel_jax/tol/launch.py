"""`angel-jax launch -n N CONFIG [key=value ...]`: the watchdog coordinator, the shell around coordinator.Watchdog.

It checks the config, starts the heartbeat server, spawns N workers (`python -m angel_jax.tol.worker`, each
calling jax.distributed.initialize with a fresh coordinator port per attempt), and then loops: heartbeats,
rejections and worker exits arrive on one queue (exits timestamped by a waiter thread per worker), every 50 ms
the machine is ticked, and its actions are carried out: spawn a group, stop a group (SIGTERM, grace, SIGKILL),
write an event, finish. Everything it decides goes to `<run_dir>/events.jsonl` (source "watchdog"); the current
state and the workers' pids to `<run_dir>/watchdog.json`; each worker's output to `<run_dir>/logs/`; at the end
the goodput report to `<run_dir>/goodput.json` and the terminal.

Exit status: 0 when the job succeeded, 1 when it failed (the summary says why), 130/143 when the launcher itself
was interrupted (the workers are stopped first).
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from angel_jax.config import Config, load_config
from angel_jax.memory.malloc import tuned
from angel_jax.tol import coordinator as co
from angel_jax.tee.events import EventLog, read_events
from angel_jax.tol.goodput import format_report, goodput
from angel_jax.tol.group import WorkerGroup, log_tail, reserve_port
from angel_jax.tol.heartbeat import HeartbeatServer, RejectionLimiter
from angel_jax.tol.slurm import (AllocationError, Placement, SlurmPlacement, daemon_addresses, inside_allocation,
                                 silent_daemons)
from angel_jax.tol.watchers import default_detectors
from angel_jax.train.finished import finished_run

TICK = 0.05
"""Seconds between ticks of the machine: the bound on how late a hang is noticed, beyond its timeout."""
EXIT_SETTLE = 0.1
"""Seconds the launcher waits after seeing a worker exit for heartbeats the worker wrote before it died."""
PROGRESS_EVERY = 10.0
"""Seconds between progress lines on the terminal."""
_QUIET = {"phase", "checkpoint", "heartbeat_resumed"}


class Interrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Launcher:
    """One job: the machine, the server, the current group, the logs."""

    def __init__(self, config: str | Path, overrides: list[str], *, workers: int, spares: int = 0,
                 cpu_devices: int | None = None, placement: Placement | None = None,
                 out: TextIO = sys.stdout, python: str = sys.executable):
        self.config_path, self.overrides = str(config), list(overrides)
        self.cfg: Config = load_config(config, overrides)  # a bad config fails here, before anything starts
        self.n, self.spares, self.cpu_devices = workers, spares, cpu_devices
        self.placement = placement or Placement.local(workers, spares)
        self.heartbeat_host, self.out, self.python = self.placement.heartbeat_host, out, python
        self.run_dir = self.cfg.run_dir.absolute()
        self.token = secrets.token_hex(32)
        self.machine = co.Watchdog(co.WatchdogPolicy.from_config(self.cfg.resilience, total_steps=self.cfg.train.steps),
                                   n_workers=workers, spares=spares, resume=self.cfg.train.resume,
                                   node_names=self.placement.nodes, ranks_per_node=self.placement.ranks_per_node)
        self.detectors: list[co.CoordinatorDetector] = default_detectors(self.cfg)
        self.inbox: queue.Queue | None = None
        self.rejections = RejectionLimiter()  # heartbeat_rejected events per sender, rate-limited
        self.group: WorkerGroup | None = None
        self._stamp = time.time()
        self._mono0, self._wall0 = time.monotonic(), time.time()
        self.events = EventLog(self.run_dir / "events.jsonl", source="watchdog", clock=lambda: self._stamp)
        self.result: co.Finish | None = None
        self.heartbeat_addr: str | None = None
        self._last_progress_line = 0.0
        self.daemons = daemon_addresses(self.placement.nodes) if self.placement.kind == "slurm" else {}
        """node -> its scheduler daemon's address, probed when a rank fails (lost nodes)."""

    # --------------------------------------------------------------------------------------------- the loop

    def run(self) -> int:
        if line := finished_run(self.cfg):  # nothing to train: no worker, no event, no goodput of 0%
            self._say(line)
            return 0
        self.run_dir.mkdir(parents=True, exist_ok=True)
        server = HeartbeatServer(self.token, self.n, host=self.heartbeat_host).start()
        self.inbox = server.inbox
        self.heartbeat_addr = server.address
        old = {s: signal.signal(s, self._interrupt) for s in (signal.SIGTERM, signal.SIGINT)}
        where = "" if self.placement.kind == "local" else (
            f", {self.placement.kind} job {getattr(self.placement, 'job_id', '')} on nodes "
            f"{','.join(dict.fromkeys(self.machine.assignment))} ({self.placement.ranks_per_node} per node)"
            + (f", spares {','.join(n for n in self.placement.nodes if n not in self.machine.assignment)}"
               if len(self.placement.nodes) * self.placement.ranks_per_node > self.n else ""))
        self._say(f"watchdog: {self.n} worker(s){where}, run directory {self.run_dir}, heartbeats on "
                  f"{self.heartbeat_addr}")
        try:
            self._do(self.machine.start(time.monotonic()), time.monotonic())
            while self.result is None:
                self._step()
        except Interrupted as e:
            return self._interrupted(e)
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
            server.close()
            self.events.close()
        return self._report()

    def _step(self) -> None:
        for item in self._batch():
            self._feed(item)
            if self.result is not None:
                return
        now = time.monotonic()
        self._do(self.machine.handle(co.Tick(now)), now)
        for detector in self.detectors:
            for report in detector.observe(now, self.machine.ranks):
                self._do(self.machine.handle(report), now)
        self._progress_line(now)

    def _batch(self) -> list[tuple]:
        """What arrived since the last tick. When a worker exited, its last heartbeats (written before it died,
        read by another thread) are waited for briefly and handled first: a process killed right after entering
        a phase has told us that phase."""
        assert self.inbox is not None
        items: list[tuple] = []
        try:
            items.append(self.inbox.get(timeout=TICK))
        except queue.Empty:
            return items
        settled = False
        while True:
            try:
                items.append(self.inbox.get_nowait())
            except queue.Empty:
                if settled or not any(i[0] == "exit" for i in items):
                    break
                time.sleep(EXIT_SETTLE)
                settled = True
        return sorted(items, key=lambda i: i[0] == "exit")  # stable: each kind keeps its order

    def _feed(self, item: tuple) -> None:
        kind, when = item[0], item[1]
        if kind == "message":
            self._do(self.machine.handle(co.Message(when, item[2])), when)
        elif kind == "exit":
            _, when, attempt, rank, code = item
            self._do(self.machine.handle(co.WorkerExited(when, attempt, rank, code)), when)
        elif kind == "rejected":
            _, when, peer, reason = item
            log_it, summary = self.rejections.admit(peer.rsplit(":", 1)[0], when)
            if summary:
                self._emit(co.Emit("heartbeat_rejected", {"peer": peer, "reason": summary}), when)
            if log_it:
                self._emit(co.Emit("heartbeat_rejected", {"peer": peer, "reason": reason}), when)

    # --------------------------------------------------------------------------------------------- actions

    def _do(self, actions: list[co.Action], now: float) -> None:
        for action in actions:
            if isinstance(action, co.Emit):
                self._emit(action, now)
            elif isinstance(action, co.Spawn):
                self._spawn(action)
            elif isinstance(action, co.StopGroup):
                self._stop(action)
            elif isinstance(action, co.Finish):
                self.result = action

    def _wall(self, mono: float) -> float:
        return self._wall0 + (mono - self._mono0)

    def _emit(self, action: co.Emit, now: float) -> None:
        self._stamp = self._wall(now)
        event = self.events.write(action.kind, **action.fields)
        if action.kind not in _QUIET:
            self._say(_human(event))
        if action.kind in ("crash", "hang") and action.fields.get("rank") is not None and self.group is not None:
            worker = self.group.workers.get(action.fields["rank"])
            if worker is not None:
                tail = log_tail(worker.log_path, 6)
                if tail:
                    self._say(f"  last lines of {worker.log_path}:\n" + "\n".join(f"    {t}" for t in tail))
        if action.kind in ("crash", "crash_settling", "hang", "heartbeat_lost") and self.daemons:
            self._probe_nodes(now)
        if action.kind in ("start", "state", "job_end"):
            self._write_status()

    def _probe_nodes(self, now: float) -> None:
        """Ask the nodes of the attempt whether their scheduler daemon still answers, before the group is stopped
        (milliseconds when they do; ~1 s to be sure of one that refuses): a node that does not is lost, and the
        failure is charged to it, not to the peer whose collective broke first."""
        for node in silent_daemons(self.daemons, list(self.machine.assignment)):
            self._do(self.machine.handle(co.NodeDown(now, node)), now)

    def _spawn(self, action: co.Spawn) -> None:
        assert self.inbox is not None
        inbox = self.inbox
        group = WorkerGroup(action.attempt, self.run_dir / "logs",
                            on_exit=lambda attempt, rank, code, when: inbox.put(("exit", when, attempt, rank, code)),
                            preexec=self.placement.preexec(), stop_signals=self.placement.stop_signals)
        port, sock = reserve_port()
        group.reserved.append(sock)
        commands = {rank: (self.placement.command(self._argv(action), node=action.nodes[rank], rank=rank,
                                                  attempt=action.attempt), self._env(action, rank, port))
                    for rank in range(self.n)}
        pids = group.spawn(commands)
        self.group = group
        now = time.monotonic()
        self._do(self.machine.handle(co.GroupStarted(now, action.attempt, pids)), now)

    def _argv(self, action: co.Spawn) -> list[str]:
        # Workers report progress through heartbeats, not a progress bar; a restart always resumes.
        extra = ["train.progress=false", f"train.resume={'true' if action.resume else 'false'}"]
        return [self.python, "-m", "angel_jax.tol.worker", self.config_path, *self.overrides, *extra]

    def _env(self, action: co.Spawn, rank: int, port: int) -> dict[str, str]:
        env = tuned(os.environ)  # huge pages, large blocks reused: see angel_jax.memory.malloc
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        host = self.placement.coordinator_host(action.nodes[0])  # the first node of the attempt
        local = self.n if self.placement.kind == "local" else self.placement.ranks_per_node
        env.pop("ANGEL_JAX_WATCHDOG_PID", None)
        env.update({
            "ANGEL_JAX_COORDINATOR_ADDRESS": f"{host}:{port}", "ANGEL_JAX_NUM_PROCESSES": str(self.n),
            "ANGEL_JAX_LOCAL_PROCESSES": str(local),  # the ranks that share a machine's cores
            "ANGEL_JAX_PROCESS_ID": str(rank), "ANGEL_JAX_HEARTBEAT_ADDR": self.heartbeat_addr,
            "ANGEL_JAX_JOB_TOKEN": self.token, "ANGEL_JAX_ATTEMPT": str(action.attempt),
            "ANGEL_JAX_NODE": action.nodes[rank], "ANGEL_JAX_PLACEMENT": self.placement.kind,
            **self.placement.worker_env(os.getpid()),
        })
        if self.cpu_devices:
            env["ANGEL_JAX_CPU_DEVICES"] = str(self.cpu_devices)
        return env

    def _stop(self, action: co.StopGroup) -> None:
        if self.group is None:
            return
        outcomes = self.group.stop(action.grace, at_once=self.machine.lost_ranks)
        now = time.monotonic()
        self._do(self.machine.handle(co.GroupStopped(now, action.attempt, outcomes)), now)

    # --------------------------------------------------------------------------------------------- output

    def _say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def _progress_line(self, now: float) -> None:
        view = self.machine.ranks.get(0)
        if view is None or now - self._last_progress_line < PROGRESS_EVERY or view.step is None:
            return
        self._last_progress_line = now
        loss = f", loss {view.loss:.4f}" if view.loss is not None else ""
        st = f", {view.step_time:.3f} s/step" if view.step_time is not None else ""
        self._say(f"[{self.machine.state.value}] attempt {self.machine.attempt}: step {view.step}/"
                  f"{self.cfg.train.steps} ({view.phase}){loss}{st}")

    def _write_status(self) -> None:
        m = self.machine
        status = {"pid": os.getpid(), "state": m.state.value, "attempt": m.attempt, "restarts": m.restarts,
                  "heartbeat_addr": self.heartbeat_addr, "excluded": m.excluded,
                  "workers": [{"rank": v.rank, "node": v.node, "pid": v.pid,
                               "log": str(self.group.workers[v.rank].log_path) if self.group else None}
                              for v in m.ranks.values()]}
        tmp = self.run_dir / "watchdog.json.tmp"
        tmp.write_text(json.dumps(status, indent=1))
        tmp.replace(self.run_dir / "watchdog.json")

    def _report(self) -> int:
        assert self.result is not None
        events = [e for e in read_events(self.run_dir / "events.jsonl") if e.get("source") == "watchdog"]
        report = goodput(_this_job(events))
        (self.run_dir / "goodput.json").write_text(json.dumps(report, indent=1) + "\n")
        log = EventLog(self.run_dir / "events.jsonl", source="watchdog")
        log.write("goodput", **report)
        log.close()
        self._say(format_report(report))
        self._say(f"job {self.result.state.value}: {self.result.summary}")
        return 0 if self.result.state == co.State.SUCCEEDED else 1

    # --------------------------------------------------------------------------------------------- interruption

    def _interrupt(self, signum: int, frame: Any) -> None:
        raise Interrupted(signum)

    def _interrupted(self, e: Interrupted) -> int:
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN)  # a second Ctrl-C must not leave workers behind
        grace = self.cfg.resilience.preempt_grace
        self._say(f"watchdog: {e} received: the workers save a checkpoint and stop (SIGKILL after {grace:g} s)")
        outcomes = self.group.stop(grace) if self.group is not None else {}
        self._stamp = time.time()
        self.events.write("job_end", state="interrupted", summary=f"the launcher received {e}",
                          outcomes={str(k): v for k, v in outcomes.items()})
        return 128 + e.signum


def _this_job(events: list[dict]) -> list[dict]:
    """The events of the newest job in a run directory that several launches appended to."""
    starts = [i for i, e in enumerate(events) if e["kind"] == "job_start"]
    return events[starts[-1]:] if starts else events


def _human(event: dict) -> str:
    kind = event["kind"]
    stamp = time.strftime("%H:%M:%S", time.localtime(event["time"]))
    text = event.get("message") or event.get("reason") or event.get("summary") or ""
    if kind == "job_start":
        policy = event.get("policy") or {}
        text = (f"{event['workers']} worker(s) on {', '.join(dict.fromkeys(event['nodes']))}, to step "
                f"{event['steps']}, up to {policy.get('max_restarts', '?')} restarts")
    elif kind == "state":
        text = f"{event['from']} -> {event['to']}: {event['reason']}"
    elif kind == "start":
        text = f"attempt {event['attempt']}: " + ", ".join(f"rank {w['rank']} pid {w['pid']} on {w['node']}"
                                                          for w in event["workers"])
    elif kind == "exit":
        text = f"rank {event['rank']} (pid {event['pid']}) {event['status']}"
    elif kind == "first_step":
        text = f"attempt {event['attempt']}: first step ({event['step']}) {event['since_start_s']:.1f} s after start"
    elif kind == "last_step":
        text = f"attempt {event['attempt']} completed step {event['step']}, the last"
    elif kind == "resumed":
        text = f"attempt {event['attempt']} resumed from step {event['step']}, lost steps: {event['lost_steps']}"
    elif kind == "recovered":
        text = ", ".join(f"{k} {v:.2f} s" for k, v in event.items() if k.endswith("_s") and v is not None)
    elif kind == "restart":
        text = (f"attempt {event['attempt']} ({event['restarts']} of {event['budget']} restarts) on "
                f"{', '.join(dict.fromkeys(event.get('nodes') or []))}")
    elif kind == "exclusion":
        text = (f"node {event['node']} excluded ({event['reason']})"
                + (f", replaced by {event['replaced_by']}" if event.get("replaced_by") else ""))
    elif kind == "stopped":
        text = "; ".join(f"rank {r} {how}" for r, how in event["outcomes"].items())
    elif kind in ("heartbeat_lost", "heartbeat_rejected"):
        text = text or f"rank {event.get('rank')}: nothing for {event.get('silent_s')} s"
        if kind == "heartbeat_rejected":
            text = f"from {event['peer']}: {event['reason']}"
    return f"{stamp} watchdog {kind}: {text}"


def launch(config: str | Path, overrides: list[str], *, workers: int | None, spares: int = 0,
           cpu_devices: int | None = None, slurm: bool | None = None, ranks_per_node: int | None = None,
           out: TextIO = sys.stdout) -> int:
    """`slurm`: True inside an allocation (job steps on its nodes), False on this machine, None: detected from
    the environment (an sbatch script or salloc shell)."""
    if slurm is None:
        slurm = inside_allocation(os.environ)
    if slurm:
        if not inside_allocation(os.environ):
            raise AllocationError("launch --slurm runs inside a Slurm allocation (an sbatch script or an salloc "
                                  "shell: SLURM_JOB_ID and SLURM_JOB_NODELIST set, not inside a job step)")
        placement, workers = SlurmPlacement.from_env(os.environ, workers=workers, spares=spares,
                                                     ranks_per_node=ranks_per_node)
    else:
        if workers is None:
            raise AllocationError("launch needs -n N outside a Slurm allocation")
        placement = Placement.local(workers, spares)
    return Launcher(config, overrides, workers=workers, spares=spares, cpu_devices=cpu_devices,
                    placement=placement, out=out).run()

