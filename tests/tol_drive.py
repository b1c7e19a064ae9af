"""The watchdog's state machine driven by hand in tests: a Watchdog with an injected clock, its actions and
emitted events, and per-rank message sequence numbers (test_tol_coordinator.py, test_tol_launch.py).
"""

from __future__ import annotations

from angel_jax.tol import coordinator as co
from angel_jax.tol.heartbeat import validate

TOKEN = "t" * 64
POLICY = co.WatchdogPolicy(total_steps=16, hang_timeout_min=5.0, hang_factor=10.0, slow_phase_timeout=100.0,
                           heartbeat_lost_after=2.0, stop_grace=3.0, max_restarts=3, no_progress_limit=0,
                           exclude_after=0, crash_settle=4.0)


class Drive:
    """A Watchdog, its actions and emitted events, and per-rank message sequence numbers."""

    def __init__(self, policy: co.WatchdogPolicy = POLICY, n: int = 2, spares: int = 0, **placement):
        self.wd = co.Watchdog(policy, n_workers=n, spares=spares, **placement)
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
