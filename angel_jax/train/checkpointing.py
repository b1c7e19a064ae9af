"""The trainer's side of checkpoints: what a checkpoint of a run holds, and when it is written and read.

A checkpoint of step k (written by `angel_jax.checkpoint.CheckpointEngine`: a memory-tier snapshot first, then a
peer copy and an orbax checkpoint in the background) holds

    arrays   every array of the engine's training state (`TrainEngine.state_snapshot`: parameters and optimizer
             state; for the paged engine, every page family wherever it lives)
    meta     {"step": k, "data": the data iterator's state, "engine": engine meta (name, page layout),
              "seed": train.seed, "config": the resolved config}

The run's persistent tier is `<run_dir>/checkpoints/<k>/` (ordinary orbax checkpoints; see
angel_jax/checkpoint/persist.py for reading one with plain orbax). The memory tier defaults to
/dev/shm/angel_jax-<uid>/<run id>, so a restarted process finds its predecessor's snapshots there.

In a multi-process run process 0 writes the checkpoints, every process reads them, and process 0 decides which
step all of them restore. Every process takes a snapshot at each save: a state sharded across the processes
(mesh.fsdp) is gathered into each one's host memory then, so process 0 holds all of it.

Fault injection (crash tests only) enters here, at the edge: the engine is built with the hook that
ANGEL_JAX_CKPT_KILL_AT describes (angel_jax/checkpoint/faults.py), read when the engine is built.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import time
import uuid
from pathlib import Path
from typing import Any

import jax
import numpy as np

from angel_jax.checkpoint import CheckpointEngine, CheckpointError, CheckpointOptions, SaveHandle, StateSnapshot
from angel_jax.checkpoint import faults
from angel_jax.checkpoint.snapshot import is_snapshot_dir
from angel_jax.config import Config, to_dict
from angel_jax.units import human_bytes

log = logging.getLogger(__name__)

RUN_TOKEN_FILE = ".checkpoint_run_token"
"""In the run directory: a random token naming this run's memory tier (see claim_memory_tier)."""
OWNER_FILE = "run_token"
"""In the memory tier's directory: the token of the run whose snapshots it holds."""


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
    owner_file = memory_root / OWNER_FILE
    ours = lambda p: (p == owner_file and _plain_file(p)) or is_snapshot_dir(p)  # noqa: E731
    foreign = sorted(p.name for p in entries if not ours(p))
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise CheckpointError(
            f"checkpoint.memory_dir {memory_root} holds {shown}, which are not checkpoint snapshots; nothing was "
            "deleted. Point checkpoint.memory_dir at an empty directory of its own (RAM-backed, such as "
            "/dev/shm/<name>), or leave it empty for /dev/shm/angel_jax-<uid>/<run id>")
    token_file = run_dir / RUN_TOKEN_FILE
    token = token_file.read_text().strip() if token_file.is_file() else None
    owner = owner_file.read_text().strip() if _plain_file(owner_file) else None
    # A run directory without a token owns no snapshot yet: whatever the tier holds then is another run's.
    stale = [p for p in entries if p != owner_file] if token is None or owner != token else []
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


ALL_DAMAGED = -2
"""restore_latest's choice when the run has committed checkpoints and none of them verifies."""
RESUMABLE_MODEL_CHANGES = ("remat", "init_from")
"""Model settings a run may change on resume: they change how the function is computed, not which function
(init_from only chooses the parameters of step 0, which a resume replaces with the checkpoint's)."""


def check_same_model(saved_config: dict | None, cfg: Config, step: int) -> None:
    """Refuse to resume a checkpoint into a model that computes another function (e.g. other n_heads: the same
    parameter shapes, a different model). Checkpoints written before the config was recorded pass."""
    saved = (saved_config or {}).get("model")
    if not isinstance(saved, dict):
        return
    now = to_dict(cfg)["model"]
    differ = [k for k in sorted(set(saved) | set(now)) if k not in RESUMABLE_MODEL_CHANGES
              and saved.get(k) != now.get(k)]
    if differ:
        changes = ", ".join(f"model.{k}={now.get(k)!r} (the checkpoint's: {saved.get(k)!r})" for k in differ)
        raise CheckpointError(f"the checkpoint of step {step} holds another model than the config asks for: "
                              f"{changes}. Resume with the checkpoint's model settings, or start a new run "
                              "(another train.run_dir, or train.resume=false)", step=step)


def checkpoint_options(cfg: Config, run_dir: Path) -> CheckpointOptions:
    c = cfg.checkpoint
    return CheckpointOptions(persistent_dir=(run_dir / "checkpoints").absolute(),
                             memory_dir=Path(c.memory_dir) if c.memory_dir else None,
                             peer_dir=Path(c.peer_dir) if c.peer_dir else None,
                             keep_last=c.keep, keep_every=c.keep_every or None,
                             verify_on_restore=c.verify_on_restore)


def training_engine(options: CheckpointOptions) -> CheckpointEngine:
    """The engine a training run saves through: with the crash tests' fault hook when the environment asks."""
    return CheckpointEngine(options, fault=faults.from_env())


class TrainCheckpointer:
    """Saves (process 0) and restores (every process) a run's training state through the checkpoint engine."""

    def __init__(self, cfg: Config, run_dir: Path, *, primary: bool):
        self.cfg = cfg
        self.options = checkpoint_options(cfg, run_dir)
        self.primary = primary
        self.run_dir = run_dir
        if primary:  # before any restore: other processes restore the step process 0 chooses
            claim_memory_tier(run_dir, self.options.resolved_memory_dir())
        self.engine = training_engine(self.options)
        self.last_handle: SaveHandle | None = None

    # --------------------------------------------------------------------------------------------- saving

    def save(self, step: int, snapshot: StateSnapshot, meta: dict[str, Any]) -> SaveHandle | None:
        """Blocks only for the memory-tier snapshot (for a held snapshot, not even for that: see
        CheckpointEngine.save), which is released when the copy is done; None on processes other than 0, which
        release the snapshot at once."""
        if not self.primary:
            snapshot.release()
            return None
        full = {"step": step, **meta, "seed": self.cfg.train.seed, "config": to_dict(self.cfg)}
        self.last_handle = self.engine.save(step, snapshot, full)
        return self.last_handle

    def wait(self) -> None:
        """Until the newest save is committed (or failed); its errors stay for poll_errors()."""
        if self.last_handle is not None:
            self.last_handle.wait()

    def poll_errors(self) -> list[CheckpointError]:
        """Background save failures since the last call: training goes on; the caller warns."""
        return self.engine.poll_errors()

    # --------------------------------------------------------------------------------------------- restoring

    def has_any(self) -> bool:
        return any(info.committed for info in self.engine.list())

    def restore_latest(self) -> tuple[int, dict[str, np.ndarray], dict[str, Any], str] | None:
        """(step, arrays, meta, tier) of the newest valid checkpoint, or None when there is none. Damaged copies
        are skipped with a warning. Every process restores the step process 0 chose."""
        chosen = -1
        if self.primary:
            ref = self.engine.latest_valid()
            chosen = ref.step if ref is not None else (ALL_DAMAGED if self.has_any() else -1)
        chosen = from_primary(chosen)
        if chosen == ALL_DAMAGED:
            # Starting over would overwrite the run's metrics and, at its first save, its checkpoints.
            raise CheckpointError(
                f"every checkpoint of the run in {self.run_dir} is damaged (see the warnings above, or `angel-jax "
                f"ckpt verify {self.run_dir}`): refusing to start over from step 1 over it. To train afresh anyway, "
                "set train.resume=false (the damaged checkpoints are moved aside, not deleted)")
        if chosen < 0:
            return None
        restored = self.engine.restore(chosen)
        return restored.step, restored.arrays, dict(restored.meta), restored.source

    def persisted(self, step: int) -> bool:
        """Whether `step` is committed in the persistent tier (process 0 looks; every process gets its answer)."""
        found = False
        if self.primary:
            tiers = {i.step: i.tiers for i in self.engine.list()}.get(step, {})
            found = "persistent" in tiers and tiers["persistent"].state == "persisted"
        return bool(from_primary(int(found)))

    def archive_existing(self) -> Path | None:
        """Move every tier's checkpoints of this run aside (train.resume=false): the new run owns the run
        directory's checkpoints, and nothing of the old run is deleted. Returns the archive directory."""
        if not self.primary or not self.has_any():
            return None
        self.engine.close()
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        persistent = self.options.persistent_dir
        archive = persistent.with_name(f"{persistent.name}.replaced-{stamp}")
        archive.mkdir(parents=True)
        for tier, root in (("persistent", persistent), ("memory", self.options.resolved_memory_dir()),
                           ("peer", self.options.peer_dir)):
            if root is not None and root.is_dir():
                shutil.move(str(root), str(archive / tier))
        log.warning("train.resume=false: the run directory's earlier checkpoints were moved to %s", archive)
        claim_memory_tier(self.run_dir, self.options.resolved_memory_dir())
        self.engine = training_engine(self.options)
        return archive

    def close(self) -> None:
        """Waits for background saves (the last checkpoint is committed before the process moves on)."""
        self.engine.close()


def from_primary(value: int) -> int:
    """Process 0's `value` on every process (what process 0 decides about the checkpoints, all of them do)."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int64(value)))


# ------------------------------------------------------------------------------------------------- inspection


def engine_for_run(run_dir: Path) -> CheckpointEngine:
    """A checkpoint engine over a run directory's tiers, as its resolved config (<run_dir>/config.yaml) names
    them; the defaults when the run wrote no config."""
    from angel_jax.config import load_recorded_config

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"run directory {run_dir} does not exist")
    config_file = run_dir / "config.yaml"
    cfg = load_recorded_config(config_file) if config_file.is_file() else Config()
    return CheckpointEngine(checkpoint_options(cfg, run_dir))


def list_table(run_dir: Path) -> list[str]:
    """`angel-jax ckpt ls`: one line per step with its state and size in each tier (no checksum reading)."""
    with engine_for_run(run_dir) as engine:
        infos = engine.list()
        roots = engine._tier_roots()
    if not infos:
        return [f"no checkpoints ({roots})"]
    lines = [f"{'step':>8}  {'memory':<22}{'peer':<22}{'persistent':<22}"]
    for info in infos:
        cells = []
        for tier in ("memory", "peer", "persistent"):
            t = info.tiers.get(tier)
            cells.append(f"{t.state} {human_bytes(t.nbytes)}" if t else "-")
        lines.append(f"{info.step:>8}  " + "".join(f"{c:<22}" for c in cells))
    lines.append(f"tiers: {roots}")
    return lines


def verify_report(run_dir: Path, step: int | None = None) -> tuple[bool, list[str]]:
    """`angel-jax ckpt verify`: read every committed copy of `step` (default: every step) and check each array's
    XXH3-64 checksum. Returns (all good, lines)."""
    with engine_for_run(run_dir) as engine:
        committed = [i.step for i in engine.list() if i.committed]
        if step is not None and step not in committed:
            return False, [f"no committed checkpoint of step {step} (committed steps: "
                           f"{', '.join(map(str, committed)) or 'none'})"]
        steps = [step] if step is not None else committed
        if not steps:
            return False, ["no committed checkpoint to verify"]
        ok, lines = True, []
        for s in steps:
            problems = engine.verify(s)
            ok = ok and not problems
            lines.append(f"step {s}: " + ("ok" if not problems else "DAMAGED"))
            lines += [f"  {p}" for p in problems]
    return ok, lines
