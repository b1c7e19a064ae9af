"""An export's directory appears whole or not at all.

    with staged(out_dir, owned) as staging:   # a new directory beside out_dir, on the same file system
        ... write every file of the export into staging ...
    # here out_dir is the complete export; on an exception (a full disk, an interrupt) it is as it was

Everything is written into `.<name>.partial-XXXX` beside the target. Once complete (every file fsynced), it is
renamed to the target when there is none; over an existing directory the two are swapped in one step (Linux's
renameat2 RENAME_EXCHANGE), so at every moment the target is the old directory or the new complete one: a kill,
a power loss or a full disk never leaves a mixture. The files of the old directory that are not the export's
(`owned` says which are: config.json, weights, tokenizer files) are hard-linked into the new one first, so a
README beside an export stays. Where the swap is not supported, the old directory is renamed aside and the new one
into place (a kill between the two leaves no target, and the old export beside it).

A staging directory is held under an flock while its export runs: one left by a killed export (the lock went with
the process) is removed by the next export to the same target; one of an export still running is left alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from models.hf.safetensors_io import CheckpointFileError, WriteFailed


class ExportTargetError(CheckpointFileError):
    """An export cannot be written where it was asked to go (a file, an unwritable place, a full disk); nothing
    that looks like a model was left there."""


def partial_prefix(out_dir: Path) -> str:
    """The name a staging directory of `out_dir` starts with (hidden, beside it)."""
    return f".{out_dir.name}.partial-"


@contextlib.contextmanager
def staged(out_dir: str | Path, owned: Callable[[str], bool]) -> Iterator[Path]:
    """A new, empty directory beside `out_dir` to write an export into, published as `out_dir` when the block
    ends normally and removed when it raises. `owned(name)`: an existing `out_dir`'s file `name` belongs to an
    earlier export (the new one replaces or drops it) rather than to the user (it is kept)."""
    shown = Path(out_dir)
    target = Path(os.path.realpath(shown))  # a symlinked target: the export goes where the link points
    check_target(shown, target)
    remove_abandoned(target)
    staging, lock = _create(shown, target)
    try:
        try:
            yield staging
            _sync_tree(staging)
            _publish(staging, target, owned)
        except WriteFailed as e:
            raise ExportTargetError(_failed(shown, staging, e.path, e.reason)) from None
        except OSError as e:
            if not _writing_export(e, staging, target):
                raise
            path = Path(e.filename) if e.filename is not None else None
            raise ExportTargetError(_failed(shown, staging, path, e.strerror or str(e))) from None
    finally:
        os.close(lock)
        shutil.rmtree(staging, ignore_errors=True)  # a failure's partial files, or the swapped-out old export


def check_target(shown: Path, target: Path) -> None:
    """Refuse a target that is, or lies under, something other than a directory, before anything is read or
    written."""
    existing = next(p for p in [target, *target.parents] if p.exists())
    if not existing.is_dir():
        named = shown if existing == target else existing
        raise ExportTargetError(f"{named} is a file, not a directory: an export is a directory of files; choose "
                                f"another path for {shown} (or remove that file)")


def remove_abandoned(target: Path) -> None:
    """Remove the staging directories a killed export of `target` left (their lock went with the process)."""
    if not target.parent.is_dir():
        return
    for path in target.parent.glob(partial_prefix(target) + "*"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # an export writing it now
        finally:
            os.close(fd)
        shutil.rmtree(path, ignore_errors=True)


def _create(shown: Path, target: Path) -> tuple[Path, int]:
    """The staging directory and the descriptor that holds its lock."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=partial_prefix(target), dir=target.parent))
    except OSError as e:
        where = e.filename or target.parent
        raise ExportTargetError(f"cannot write the export {shown}: cannot create a directory in {where}: "
                                f"{e.strerror or e} (an export is written beside its target and renamed into "
                                "place: choose a writable place)") from None
    lock = os.open(staging, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(lock, fcntl.LOCK_EX)
    os.chmod(staging, 0o755)  # mkdtemp's 0700 would make the published export private
    return staging, lock


WRITE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)
"""The errors only a write gets: one without a file name (a write() that ran out of space names none) is the
export's."""


def _failed(shown: Path, staging: Path, path: Path | None, reason: str) -> str:
    if path is not None:
        with contextlib.suppress(ValueError):
            path = path.relative_to(staging)
    where = f" ({path})" if path is not None else ""
    return f"cannot write the export {shown}{where}: {reason}; nothing was written to {shown}"


def _writing_export(e: OSError, *dirs: Path) -> bool:
    """Whether the failed operation was writing the export: on one of `dirs` or a file in them, or one that only a
    write fails with (not, say, a checkpoint being read, which keeps its own error)."""
    names = [Path(str(n)) for n in (e.filename, getattr(e, "filename2", None)) if n is not None]
    if not names:
        return e.errno in WRITE_ERRORS
    return any(n == d or d in n.parents for n in names for d in dirs)


def _sync_tree(directory: Path) -> None:
    """Every file of the export and the directory itself on disk before the rename makes them the export."""
    for path in [*directory.rglob("*"), directory]:
        if path.is_symlink():
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _publish(staging: Path, target: Path, owned: Callable[[str], bool]) -> None:
    if not os.path.lexists(target):
        os.rename(staging, target)
        return
    for entry in target.iterdir():
        if not owned(entry.name) and not os.path.lexists(staging / entry.name):
            _link(entry, staging / entry.name)
    try:
        _exchange(staging, target)
    except OSError as e:
        if e.errno not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
            raise
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.rename(target, old / target.name)
        os.rename(staging, target)
        shutil.rmtree(old, ignore_errors=True)
        staging.mkdir()  # for the caller's removal, which expects it


def _link(src: Path, dst: Path) -> None:
    """`src` (a user's file kept beside the new export) at `dst` too, without copying its bytes."""
    if src.is_symlink():
        os.symlink(os.readlink(src), dst)
    elif src.is_dir():
        shutil.copytree(src, dst, symlinks=True, copy_function=_hard_link)
    else:
        _hard_link(src, dst)


def _hard_link(src: str | Path, dst: str | Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # a file system without hard links: a copy
        shutil.copy2(src, dst)


def _exchange(a: Path, b: Path) -> None:
    """Swap two paths in one step (renameat2 RENAME_EXCHANGE); OSError ENOSYS where the C library has none."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available", str(a))
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(a), None, str(b))
