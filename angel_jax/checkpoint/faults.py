"""Fault injection for the crash tests: SIGKILL this process at a named point of a save. Test use only.

The checkpoint code takes faults as a callable, `fault(point, step)`, called at each point below; the default
(`no_fault`) does nothing. Nothing under angel_jax/checkpoint reads the environment: the program's edge (the
trainer building its checkpoint manager, a crash test's child process) builds the callable with `from_env()`.

Set `ANGEL_JAX_CKPT_KILL_AT=<point>` or `<point>@<step>` in a child process's environment; when the engine reaches
that point (for that step) the process kills itself with SIGKILL, the way an OOM killer or a node failure would:
no finally blocks, no atexit, no flushing. Points:

    snapshot.copy      after the first array was copied into step_<k>.tmp (mid-snapshot)
    snapshot.commit    in the background, index.json written, before step_<k>.tmp is renamed to step_<k>
    peer.commit        peer copy written, before its rename
    persist.commit     orbax has written all data of the step to its tmp directory, before orbax's commit rename
"""

from __future__ import annotations

import os
import signal
from typing import Callable, Mapping

ENV = "ANGEL_JAX_CKPT_KILL_AT"
POINTS = ("snapshot.copy", "snapshot.commit", "peer.commit", "persist.commit")

Fault = Callable[[str, int], None]
"""Called with (point, step) at every fault point of a save."""


def no_fault(point: str, step: int) -> None:
    """The production fault hook: nothing happens."""


def kill_at(target: str) -> Fault:
    """A hook that SIGKILLs the process at `<point>` (any step) or `<point>@<step>`."""
    name, _, at_step = target.partition("@")
    wanted = int(at_step) if at_step else None

    def fault(point: str, step: int) -> None:
        if point == name and (wanted is None or wanted == step):
            os.kill(os.getpid(), signal.SIGKILL)

    return fault


def from_env(environ: Mapping[str, str] = os.environ) -> Fault:
    """`kill_at(ANGEL_JAX_CKPT_KILL_AT)` when the variable is set (and not empty), else `no_fault`."""
    target = environ.get(ENV)
    return kill_at(target) if target else no_fault
