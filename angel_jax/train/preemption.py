"""Stopping on SIGTERM or SIGINT with a checkpoint: what spot and preemptible machines, Slurm's `--signal` and a
Kubernetes termination grace period send before they kill a run, and what Ctrl-C sends.

The handler only records the signal: the training loop reads it between steps, finishes the step in flight, saves
a checkpoint of it and stops with `Preempted` (exit status 128 + the signal's number: 143, 130). Raising from the
handler instead would unwind whatever the main thread was inside (a compiled step, a checkpoint write): with
worker threads and XLA's own threads alive that aborted the process (`terminate called without an active
exception`, exit 134) and saved nothing. A second signal of either kind stops at once, without a save.

A run of several processes must stop at the same step in all of them (the save is collective, and a process that
dispatched one more step than its peers would wait in that step's collectives forever), and the signal reaches
them at different moments, or only one of them (a preempted host). There `jax.distributed`'s preemption service
takes SIGTERM: it tells every process, they agree on a step (one past the largest any had reached), and
`reached_preemption_sync_point(step)`, asked at every step, is true at that step in all of them (`SyncedStop`).
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType
from typing import Any

from angel_jax.errors import AngelError

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(AngelError):
    """The run stopped on a signal after saving a checkpoint of its last finished step."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class StopSignals:
    """While active (a context manager), SIGTERM and SIGINT set `signum` instead of stopping the process; the
    previous handlers come back on exit. Inactive (a no-op) off the main thread, where Python cannot install
    handlers, and when `enabled` is false (`checkpoint.on_signal: false`)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def should_stop(self, step: int) -> bool:
        """Whether to stop, with a checkpoint, before dispatching the step after `step`."""
        return self.signum is not None

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:  # the second one: stop now, as without this handler
            self.__exit__()
            raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(128 + signum)
        self.signum = signum
        print(f"{signal.Signals(signum).name}: stopping after the step in flight, with a checkpoint of it (a second "
              "signal stops at once, without one)", file=sys.stderr, flush=True)

    def __enter__(self) -> "StopSignals":
        if self.enabled:
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


class SyncedStop:
    """A stop all processes of a `jax.distributed` job agree on, through jax's preemption service (which handles
    SIGTERM in each process once `jax.distributed.initialize` ran): `should_stop(step)` must be asked at every
    step, with the same steps, by every process; it is true at the same step in all of them."""

    signum = signal.SIGTERM
    name = "SIGTERM"

    def __init__(self) -> None:
        self.requested = False

    def should_stop(self, step: int) -> bool:
        from jax.experimental import multihost_utils

        if not self.requested and multihost_utils.reached_preemption_sync_point(step):
            self.requested = True
            print(f"SIGTERM reached a process of this job: every process stops after step {step}, with a "
                  "checkpoint of it", file=sys.stderr, flush=True)
        return self.requested

    def __enter__(self) -> "SyncedStop":
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def stop_source(enabled: bool) -> StopSignals | SyncedStop:
    """What stops this run with a checkpoint: SIGTERM through jax's preemption service in a multi-process job
    (SIGINT there stops at once: a Ctrl-C on a terminal reaches every process of the job anyway), the signal
    handlers of `StopSignals` in a one-process run; nothing when not `enabled`."""
    import jax

    if enabled and jax.distributed.is_initialized() and jax.config.jax_enable_preemption_service:
        return SyncedStop()
    return StopSignals(enabled)
