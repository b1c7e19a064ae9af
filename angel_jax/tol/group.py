"""The worker processes of one attempt: spawn them with their environment, see them exit, stop them all.

    group = WorkerGroup(attempt=0, log_dir=run_dir / "logs", on_exit=lambda rank, code, t: ...)
    group.spawn({0: (argv, env), 1: (argv, env)})
    group.stop(grace=10.0)      # SIGTERM (+ SIGCONT for a stopped process), grace, SIGKILL; -> rank -> outcome

Each worker runs in its own session (process group), so a stop reaches whatever it started and a Ctrl-C at the
launcher's terminal does not hit the workers behind the watchdog's back. A thread per worker waits for its exit
and reports it at once, with the time, so the watchdog sees exits in the order they happened (the first is the
cause; a peer that aborts in a broken collective comes after). Output goes to
`<log_dir>/attempt<a>-rank<r>.log`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from angel_jax.tol.coordinator import describe_status


@dataclass
class Worker:
    rank: int
    proc: subprocess.Popen
    log_path: Path


def reserve_port(host: str = "127.0.0.1") -> tuple[int, socket.socket]:
    """A free TCP port, held: the returned socket stays bound (SO_REUSEPORT, not listening) so no other process
    is handed the port until it is closed, while JAX's coordination service (gRPC binds with SO_REUSEPORT) can
    still listen on it. Close the socket once the attempt is over."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, 0))
    return sock.getsockname()[1], sock


def log_tail(path: Path, lines: int = 8) -> list[str]:
    """The last non-empty lines of a worker's log (for failure messages)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 16384))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip()][-lines:]


class WorkerGroup:
    """One attempt's workers."""

    def __init__(self, attempt: int, log_dir: Path, on_exit: Callable[[int, int, int, float], None],
                 clock: Callable[[], float] = time.monotonic, preexec: Callable[[], None] | None = None,
                 stop_signals: Sequence[int] = ()):
        self.attempt = attempt
        self.preexec = preexec
        """Run in each child before exec (e.g. a parent-death signal for an `srun`)."""
        self.stop_signals = tuple(stop_signals)
        """Sent, 0.3 s apart, to what is still running after the stop grace, before SIGKILL (`srun`: two SIGINTs
        cancel its job step, which SIGKILL of `srun` itself would leave running)."""
        self.log_dir = Path(log_dir)
        self.on_exit = on_exit
        """on_exit(attempt, rank, returncode, when): from the waiter thread."""
        self.clock = clock
        self.workers: dict[int, Worker] = {}
        self.reserved: list[socket.socket] = []

    def spawn(self, commands: Mapping[int, tuple[Sequence[str], Mapping[str, str]]],
              cwd: Path | None = None) -> dict[int, int]:
        """Starts every rank's (argv, env); returns rank -> pid."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for rank, (argv, env) in sorted(commands.items()):
            path = self.log_dir / f"attempt{self.attempt}-rank{rank}.log"
            with open(path, "ab") as out:
                proc = subprocess.Popen(list(argv), env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=self.preexec)
            self.workers[rank] = Worker(rank, proc, path)
            threading.Thread(target=self._wait, args=(rank, proc), name=f"wait-rank{rank}", daemon=True).start()
        return {rank: w.proc.pid for rank, w in self.workers.items()}

    def _wait(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        self.on_exit(self.attempt, rank, code, self.clock())

    def alive(self) -> list[int]:
        return [r for r, w in self.workers.items() if w.proc.poll() is None]

    def _signal(self, ranks: Sequence[int], sig: int) -> None:
        for rank in ranks:
            try:
                os.killpg(self.workers[rank].proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def stop(self, grace: float, at_once: Sequence[int] = ()) -> dict[int, str]:
        """SIGTERM every live worker's process group (and SIGCONT, so a stopped process can act on it), wait up
        to `grace` seconds, SIGKILL what is left. The ranks `at_once` (on a lost node: nothing of theirs can stop
        gracefully) get SIGKILL first. Returns rank -> how it ended."""
        before = {r: w.proc.poll() for r, w in self.workers.items()}
        at_once = [r for r in at_once if before.get(r, 0) is None]
        self._signal(at_once, signal.SIGKILL)
        live = [r for r, code in before.items() if code is None and r not in at_once]
        self._signal(live, signal.SIGTERM)
        self._signal(live, signal.SIGCONT)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and self.alive():
            time.sleep(0.02)
        for sig in self.stop_signals:
            self._signal(self.alive(), sig)
            time.sleep(0.3)
        if self.stop_signals:  # give the scheduler a moment to cancel the steps
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline and self.alive():
                time.sleep(0.05)
        killed = self.alive()
        self._signal(killed, signal.SIGKILL)
        outcomes: dict[int, str] = {}
        for rank, w in self.workers.items():
            try:
                code = w.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # unkillable (D state): say so rather than block forever
                outcomes[rank] = f"still running after SIGKILL (pid {w.proc.pid})"
                continue
            if before[rank] is not None:
                outcomes[rank] = f"had already {describe_status(code).replace('was ', 'been ')}"
            elif rank in at_once:
                outcomes[rank] = "killed by SIGKILL at once (its node was lost)"
            elif rank in killed:
                outcomes[rank] = f"killed by SIGKILL after {grace:g} s grace"
            else:
                outcomes[rank] = ("exited with status 143" if code == 143 else describe_status(code)) + " after SIGTERM"
        self.release()
        return outcomes

    def release(self) -> None:
        for sock in self.reserved:
            sock.close()
        self.reserved = []
