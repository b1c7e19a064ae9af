"""Fault injection for the crash tests: SIGKILL this process at a named point of a save. Test use only.

Set `ANGEL_JAX_CKPT_KILL_AT=<point>` or `<point>@<step>` in a child process's environment; when the engine reaches
that point (for that step) the process kills itself with SIGKILL, the way an OOM killer or a node failure would:
no finally blocks, no atexit, no flushing. Points:

    snapshot.copy      in save(), after the first array was copied into step_<k>.tmp (mid-snapshot)
    snapshot.commit    in the background, index.json written, before step_<k>.tmp is renamed to step_<k>
    peer.commit        peer copy written, before its rename
    persist.commit     orbax has written all data of the step to its tmp directory, before orbax's commit rename

Unset (the normal case) the check is one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "ANGEL_JAX_CKPT_KILL_AT"
POINTS = ("snapshot.copy", "snapshot.commit", "peer.commit", "persist.commit")


def fault_point(point: str, step: int) -> None:
    """SIGKILLs the process if ANGEL_JAX_CKPT_KILL_AT names this point (and step, if given)."""
    target = os.environ.get(ENV)
    if not target:
        return
    name, _, at_step = target.partition("@")
    if name == point and (not at_step or int(at_step) == step):
        os.kill(os.getpid(), signal.SIGKILL)
