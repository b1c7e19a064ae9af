"""Which checkpoint directories may be loaded: a checkpoint is code-equivalent (its weights decide what the model
does), so one planted by another user, or in a directory other users can write to, is never loaded, whatever
reads it (`train`, `sample`, `export`, `ckpt`): the checkpoint manager applies this to every tier's root and every
step's directory before it lists, verifies or restores anything."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def untrusted(path: Path, *, root: bool = False) -> str | None:
    """Why the checkpoint directory `path` (a tier's `root`, or one step's directory) cannot be trusted; None when
    it can, or when it does not exist. A root others may write to is trusted when it is sticky (a tmpfs mount's
    1777, /tmp): others can add entries there but not replace this user's, and each entry is checked itself."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot be inspected ({e.strerror or e})"
    if st.st_uid != os.getuid():
        return f"belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})"
    if st.st_mode & 0o022 and not (root and st.st_mode & stat.S_ISVTX):
        return f"is writable by other users (mode {stat.S_IMODE(st.st_mode):o}; `chmod go-w` it if that is safe)"
    return None
