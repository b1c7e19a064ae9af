"""One run per run directory: process 0 holds an exclusive lock on it for the whole run.

Two runs writing one run directory delete each other's temporary checkpoints and end with one run's metrics and
the other's checkpoints; the second run is refused instead, naming the holder. The lock is `flock` on
<run_dir>/.lock, which the kernel releases when the holder exits in any way (SIGKILL included): a crashed run
never leaves a stale lock behind, and a restarted one takes it again. The file names the holder (pid, host) for
the refusal's message.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from angel_jax.config import ConfigError
from angel_jax.errors import AngelError

LOCK_FILE = ".lock"


class RunDirectoryInUse(AngelError):
    """Another live process holds the run directory's lock."""


class RunDirLock:
    """The held lock; `release()` (idempotent) gives it back, and so does the end of the process."""

    def __init__(self, path: Path, fd: int):
        self.path, self._fd = path, fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def lock_run_dir(run_dir: Path) -> RunDirLock:
    """Create `run_dir` if needed and lock it; raises RunDirectoryInUse when another run holds it, ConfigError
    when it cannot be a run directory (a file, no permission)."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"'train.run_dir' {run_dir} exists and is not a directory")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ConfigError(f"'train.run_dir' {run_dir} cannot be used: {e.strerror or e}") from e
    if holder := take_lock(fd):
        raise RunDirectoryInUse(f"run directory {run_dir} is in use by another run ({holder}); wait for it to "
                                "end or choose another train.run_dir")
    return RunDirLock(run_dir / LOCK_FILE, fd)


def take_lock(fd: int) -> str | None:
    """Lock the open file `fd` (flock, exclusive, without waiting) and write this process's name into it; None when
    taken, else the holder's name as its file says (and `fd` is closed)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "a process that has not said who it is"
        os.close(fd)
        return holder
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    return None
