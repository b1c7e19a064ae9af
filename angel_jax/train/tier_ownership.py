"""Which run a checkpoint memory tier belongs to. The memory tier (/dev/shm by default) outlives its run directory,
so a run claims it with a random token written in both places, and locks it while it runs: a second run naming the
same tier is refused before anything is deleted, and a reader skips a tier that holds another run's snapshots.

    claim_memory_tier(run_dir, memory_root)       # lock it, and start it afresh unless it is this run's
    owns_memory_tier(run_dir, memory_root)        # (readers) are these snapshots this run's?
    release_memory_tier(memory_root)
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import uuid
from pathlib import Path

from angel_jax.checkpoint import CheckpointError
from angel_jax.checkpoint.snapshot import is_snapshot_dir
from angel_jax.train.rundir import take_lock

log = logging.getLogger(__name__)

PROCESS_DIR = re.compile(r"process_(\d+)")
"""Every tier's subdirectory of one process's checkpoints, where each process writes its own shards."""
RUN_TOKEN_FILE = ".checkpoint_run_token"
"""In the run directory: a random token naming this run's memory tier (see claim_memory_tier)."""
OWNER_FILE = "run_token"
"""In the memory tier's directory: the token of the run whose snapshots it holds."""
TIER_LOCK_FILE = ".lock"
"""In the memory tier's directory: locked (flock) by the process whose run uses the tier, naming it."""
_held_tier_locks: dict[str, int] = {}
"""This process's memory-tier locks: resolved directory -> the locked file's descriptor."""


def lock_memory_tier(memory_root: Path) -> bool:
    """Lock the memory tier for this process's run until `release_memory_tier` (or the process's end): a second
    run naming the same checkpoint.memory_dir is refused with CheckpointError naming the holder, before it deletes
    anything (it would take the first run's live snapshots for a stale run's). False when the directory cannot be
    made (no memory tier then: checkpoints are persisted directly)."""
    key = str(Path(memory_root).resolve())
    if key in _held_tier_locks:
        return True
    try:
        Path(memory_root).mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(Path(memory_root) / TIER_LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError:
        return False
    if holder := take_lock(fd):
        raise CheckpointError(f"checkpoint.memory_dir {memory_root} is in use by another run ({holder}); nothing "
                              "was deleted: give each run a memory_dir of its own (or leave it empty for one "
                              "named after the run directory)")
    _held_tier_locks[key] = fd
    return True


def release_memory_tier(memory_root: Path) -> None:
    fd = _held_tier_locks.pop(str(Path(memory_root).resolve()), None)
    if fd is not None:
        os.close(fd)  # (the lock goes with the descriptor)


def claim_memory_tier(run_dir: Path, memory_root: Path) -> bool:
    """Ties the memory tier to this run directory; True when it removed another run's snapshots.

    The memory tier outlives the run directory (/dev/shm survives `rm -rf runs/x`), and its default name depends
    only on the run directory's path: a new run at the same path would otherwise resume a deleted run. The run
    directory holds a random token and the memory tier a copy of it; snapshots under another token, or under
    none, belong to another run and are removed (the persistent tier, inside the run directory, is untouched).

    Nothing else is ever deleted: a memory tier holding anything that is not a snapshot (a user's files, a run
    directory, persistent checkpoints) is refused with CheckpointError before anything is touched. A memory tier
    that cannot be a directory at all (a file, a path under /proc) is left alone with a warning: the checkpoint
    engine then persists every checkpoint directly, as it does when the tier is full."""
    memory_root, run_dir = Path(memory_root), Path(run_dir)
    if memory_root.exists() and not memory_root.is_dir():
        log.warning("checkpoint.memory_dir %s is not a directory: no memory tier, checkpoints are persisted "
                    "directly", memory_root)
        return False
    if memory_root.is_dir():
        _refuse_unless_private(memory_root)
    entries = list(memory_root.iterdir()) if memory_root.is_dir() else []
    owner_file, lock_file = memory_root / OWNER_FILE, memory_root / TIER_LOCK_FILE
    ours = lambda p: (p in (owner_file, lock_file) and _plain_file(p)) or is_snapshot_dir(p) or \
        (PROCESS_DIR.fullmatch(p.name) is not None and p.is_dir() and not p.is_symlink())  # noqa: E731
    foreign = sorted(p.name for p in entries if not ours(p))
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise CheckpointError(
            f"checkpoint.memory_dir {memory_root} holds {shown}, which are not checkpoint snapshots; nothing was "
            "deleted. Point checkpoint.memory_dir at an empty directory of its own (RAM-backed, such as "
            "/dev/shm/<name>), or leave it empty for /dev/shm/angel_jax-<uid>/<run id>")
    lock_memory_tier(memory_root)  # (refused here, before anything below is deleted, when a live run holds it)
    token_file = run_dir / RUN_TOKEN_FILE
    token = token_file.read_text().strip() if token_file.is_file() else None
    owner = owner_file.read_text().strip() if _plain_file(owner_file) else None
    # A run directory without a token owns no snapshot yet: whatever the tier holds then is another run's.
    stale = [p for p in entries if p not in (owner_file, lock_file)] if token is None or owner != token else []
    if stale:
        log.warning("memory tier %s holds snapshots of another run (not of the run directory %s): removed %s",
                    memory_root, run_dir, ", ".join(sorted(p.name for p in stale)))
        for p in stale:
            shutil.rmtree(p)
    if token is None:
        token = uuid.uuid4().hex
        _write_private(token_file, token + "\n")
    if owner != token:
        try:
            memory_root.mkdir(mode=0o700, parents=True, exist_ok=True)
            _write_private(owner_file, token + "\n")
        except OSError as e:
            log.warning("checkpoint.memory_dir %s cannot be created (%s): no memory tier, checkpoints are "
                        "persisted directly", memory_root, e.strerror or e)
    return bool(stale)


def owns_memory_tier(run_dir: Path, memory_root: Path) -> bool:
    """Whether the memory tier holds the snapshots of this run directory (its token is the run's; see
    claim_memory_tier). For readers of a run, which change nothing: a tier of another run (a deleted run at the
    same path, or a checkpoint.memory_dir shared by two runs) is not to be read as this run's."""
    token_file, owner_file = Path(run_dir) / RUN_TOKEN_FILE, Path(memory_root) / OWNER_FILE
    if not (_plain_file(token_file) and _plain_file(owner_file)):
        return False
    return token_file.read_text().strip() == owner_file.read_text().strip()


def _refuse_unless_private(memory_root: Path) -> None:
    """A memory tier another user owns or may write to could hold snapshots planted there (a forged step with
    chosen weights would be resumed like any other): refuse it, and a parent others may replace it in."""
    st = memory_root.stat()
    if st.st_uid != os.getuid():
        raise CheckpointError(f"checkpoint.memory_dir {memory_root} belongs to uid {st.st_uid}, not to this user "
                              f"(uid {os.getuid()}): its snapshots cannot be trusted; use a directory of your own")
    if st.st_mode & 0o022:
        raise CheckpointError(f"checkpoint.memory_dir {memory_root} is writable by other users (mode "
                              f"{stat.S_IMODE(st.st_mode):o}): its snapshots cannot be trusted; `chmod go-w` it "
                              "or use a private directory")
    parent = memory_root.resolve().parent
    pst = parent.stat()
    if pst.st_mode & 0o022 and not pst.st_mode & stat.S_ISVTX or pst.st_uid not in (0, os.getuid()):
        raise CheckpointError(f"checkpoint.memory_dir {memory_root}: its parent {parent} belongs to uid "
                              f"{pst.st_uid} or lets other users replace the memory tier (mode "
                              f"{stat.S_IMODE(pst.st_mode):o}, no sticky bit): use a private directory")


def _write_private(path: Path, text: str) -> None:
    """A file only this user can read (a run token names the run's memory tier)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)  # an existing file keeps its mode through O_CREAT


def _plain_file(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()
