"""Which checkpoint directories may be loaded: a checkpoint is code-equivalent (its weights decide what the model
does), so one planted by another user, in a directory other users can write to, or reached through a symlink that
leads out of where the run keeps its checkpoints (another run's step, or another run's `checkpoints/`), is never
loaded, whatever reads it (`train`, `sample`, `export`, `ckpt`): the checkpoint manager applies this to every
tier's root and every step's directory before it lists, verifies or restores anything."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def untrusted(path: Path, *, root: bool = False, within: Path | None = None) -> str | None:
    """Why the checkpoint directory `path` (a tier's `root`, or one step's directory) cannot be trusted; None when
    it can, or when it does not exist. A root others may write to is trusted when it is sticky (a tmpfs mount's
    1777, /tmp): others can add entries there but not replace this user's, and each entry is checked itself.
    `within`: the directory `path` must stay inside once every symlink on the way from it is followed (a step's
    tier root; the persistent tier's run directory); a symlink inside it is followed and its target checked."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot be inspected ({e.strerror or e})"
    if within is not None and (escape := leaves(Path(path), Path(within))):
        return escape
    if st.st_uid != os.getuid():
        return f"belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})"
    if stat.S_ISLNK(st.st_mode):  # a link's own mode is always 777: what counts is its target's
        try:
            st = os.stat(path)
        except OSError as e:
            return f"is a symlink to {os.path.realpath(path)}, which cannot be inspected ({e.strerror or e})"
    if st.st_uid != os.getuid():
        return f"belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})"
    if st.st_mode & 0o022 and not (root and st.st_mode & stat.S_ISVTX):
        return f"is writable by other users (mode {stat.S_IMODE(st.st_mode):o}; `chmod go-w` it if that is safe)"
    return None


def leaves(path: Path, within: Path) -> str | None:
    """How `path` (inside `within` by name) leads out of `within` through a symlink, naming the link and where it
    points; None when every symlink on the way stays inside (or `path` is not inside `within` by name)."""
    path, within = Path(os.path.abspath(path)), Path(os.path.abspath(within))
    if not path.is_relative_to(within):
        return None
    base = Path(os.path.realpath(within))
    here = within
    for part in path.relative_to(within).parts:
        here = here / part
        if here.is_symlink() and not Path(os.path.realpath(here)).is_relative_to(base):
            return (f"is reached through the symlink {here} -> {os.path.realpath(here)}, which leads out of "
                    f"{within} (another run's checkpoints?)")
    return None
