"""The trainer's side of checkpoints: what a checkpoint of a run holds, and when it is written and read.

A checkpoint of step k (written by `angel_jax.checkpoint.CheckpointManager`: a memory-tier snapshot first, then a
peer copy and an orbax checkpoint in the background) holds

    arrays   every array of the engine's training state (`TrainEngine.state_snapshot`: parameters and optimizer
             state; for the paged engine, every page family wherever it lives)
    meta     {"step": k, "data": the data iterator's state, "engine": engine meta (name, page layout),
              "seed": train.seed, "config": the resolved config, "identity": what the run trains on (the
              tokenizer's fingerprint, the sha256 of the data's sources: data/identity.py)}

in the format of the engine that wrote it (its array names, meta and assembly: train/state_formats.py).

The run's persistent tier is `<run_dir>/checkpoints/<k>/` (ordinary orbax checkpoints; see
angel_jax/checkpoint/persist.py for reading one with plain orbax). The memory tier defaults to
/dev/shm/angel_jax-<uid>/<run id>, so a restarted process finds its predecessor's snapshots there.

In a multi-process run whose state is replicated on every process, process 0 writes the checkpoints, every
process reads them, and process 0 decides which step all of them restore.

A state sharded across processes (the paged engine's pages, the in-memory engine's leaves under mesh.fsdp:
`TrainEngine.checkpoints_per_process`) is checkpointed per process instead (TRANSOM's layout): each process
writes only its own shards, through tiers of its own,

    <run_dir>/checkpoints/process_<p>/<k>/       its persistent copies: orbax checkpoints of its shards, written
                                                 by that process alone (checkpoint/orbax_local.py)
    <memory tier>/process_<p>/step_<k>/          its snapshots
    <checkpoint.peer_dir>/process_<p>/           its peer copies: a neighbour host's mount, so the loss of this
                                                 host's memory loses nothing (or, over the network, in the next
                                                 node's memory: train/peer_network.py)

and on restore the processes agree on the newest step every one of them can restore (each from its fastest
valid tier). A run over another set of processes (fewer, more, or one) resumes the newest step committed in
every process's persistent tier, assembled into whole pages or leaves (`assemble_shards`), and logs that it did.

A resume continues the same run or is refused (`check_same_run`): the config's model, and the identity recorded
in the checkpoint against the run's own (another tokenizer of the same vocabulary, a source replaced by another
of the same size), unless train.allow_data_change says to go on.

Fault injection (crash tests only) enters here, at the edge: the engine is built with the hook that
ANGEL_JAX_CKPT_KILL_AT describes (angel_jax/checkpoint/faults.py), read when the engine is built.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from angel_jax.checkpoint import CheckpointManager, CheckpointError, CheckpointOptions, SaveHandle, StateSnapshot
from angel_jax.checkpoint import faults
from angel_jax.checkpoint.filetier import FileTier
from angel_jax.checkpoint.netpeer import NetworkPeerTier
from angel_jax.checkpoint.persist import OrbaxTier
from angel_jax.checkpoint.snapshot import SnapshotDamaged
from angel_jax.checkpoint.trust import untrusted
from angel_jax.config import Config, ConfigError, to_dict
from angel_jax.data import identity as data_identity
from angel_jax.multihost import barrier, every_process_lists, from_any, from_primary
from angel_jax.tee.events import EventLog
from angel_jax.train.peer_network import network_peer, per_node
from angel_jax.train.state_formats import format_of
from angel_jax.train.tier_ownership import OWNER_FILE, PROCESS_DIR, claim_memory_tier, release_memory_tier

log = logging.getLogger(__name__)

ALL_DAMAGED = -2
"""restore_latest's choice when the run has committed checkpoints and none of them verifies."""
RESUMABLE_MODEL_CHANGES = ("remat", "init_from")
"""Model settings a run may change on resume: they change how the function is computed, not which function
(init_from only chooses the parameters of step 0, which a resume replaces with the checkpoint's)."""


def check_same_model(saved_config: dict | None, cfg: Config, step: int) -> None:
    """Refuse to resume a checkpoint into a model that computes another function (e.g. other n_heads: the same
    parameter shapes, a different model). Checkpoints written before the config was recorded pass; a key the
    checkpoint's config lacks (one added to ModelConfig since) stands for its default, the model it computed."""
    saved = (saved_config or {}).get("model")
    if not isinstance(saved, dict):
        return
    saved = {**to_dict(Config())["model"], **saved}
    now = to_dict(cfg)["model"]
    differ = [k for k in sorted(set(saved) | set(now)) if k not in RESUMABLE_MODEL_CHANGES
              and saved.get(k) != now.get(k)]
    if differ:
        changes = ", ".join(f"model.{k}={now.get(k)!r} (the checkpoint's: {saved.get(k)!r})" for k in differ)
        raise CheckpointError(f"the checkpoint of step {step} holds another model than the config asks for: "
                              f"{changes}. Resume with the checkpoint's model settings, or start a new run "
                              "(another train.run_dir, or train.resume=false)", step=step)


def check_processes_agree(identity: dict[str, Any] | None) -> None:
    """Every process of a job trains on process 0's tokenizer and data (a host with another tokenizer file or corpus
    would train another model without a word): ConfigError naming the processes that differ, on every process (a
    collective each start, every process calls it). It also compiles, in a job's first attempt, the one program a
    resume's comparison runs (from_any), so that a restarted process loads every program from the cache."""
    if jax.process_count() == 1:
        return
    what = {k: v for k, v in (identity or {}).items() if k != "files"}  # paths may differ between hosts
    digest = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).digest()
    words = [int.from_bytes(digest[i:i + 3], "big") for i in range(0, 21, 3)]  # 24-bit words: int32 on device
    rows = every_process_lists(words)
    others = [p for p, row in enumerate(rows) if row != rows[0]]
    if others:
        raise ConfigError(f"process(es) {', '.join(map(str, others))} of this job train on another tokenizer or "
                          "other data than process 0: give every host the same data.source, data.dir and tokenizer "
                          "files")


def check_same_run(meta: dict[str, Any], cfg: Config, identity: dict[str, Any] | None, step: int) -> None:
    """Refuse to resume a checkpoint (its `meta`) into another run: another model (check_same_model), or another
    tokenizer or other training data than its recorded identity (data/identity.py), unless
    train.allow_data_change says to. Every process compares its own data, and all refuse when any does (a
    collective: every process calls it). A checkpoint written before identities were recorded resumes uncompared."""
    check_same_model(meta.get("config"), cfg, step)
    saved = meta.get("identity")
    if identity is None or not isinstance(saved, dict):
        if identity is not None:
            log.warning("the checkpoint of step %d records no tokenizer or data fingerprint (written before "
                        "checkpoints recorded them): resuming without comparing them", step)
        return
    source = f"data.source={cfg.data.source}"
    differ = data_identity.changes(saved, identity, source_key=source, tokenizer_key=(
        f"data.tokenizer_path={cfg.data.tokenizer_path}" if cfg.data.tokenizer == "hf" else
        f"data.tokenizer={cfg.data.tokenizer}"))
    if differ and cfg.train.allow_data_change:
        log.warning("train.allow_data_change: resuming the checkpoint of step %d on changed data: %s", step,
                    "; ".join(differ))
        differ = []
    if from_any(bool(differ)):
        detail = "; ".join(differ) or "another process's tokenizer or data differ (see its message)"
        raise CheckpointError(f"the checkpoint of step {step} was trained on other data than this run's: {detail}. "
                              "Resume with the checkpoint's tokenizer and data, start a new run (train.resume=false, "
                              "or another train.run_dir), or set train.allow_data_change=true to resume on this data "
                              "anyway", step=step)


def checkpoint_options(cfg: Config, run_dir: Path, process: int | None = None) -> CheckpointOptions:
    """The tiers of a run's checkpoints; with `process`, those of that process's own shards: a `process_<p>`
    directory in each tier (in the run's memory tier, the default one or checkpoint.memory_dir)."""
    c = cfg.checkpoint
    persistent = (run_dir / "checkpoints").absolute()
    memory = Path(per_node(c.memory_dir)) if c.memory_dir else None
    if process is not None:  # inside the run's memory tier, checkpoint.memory_dir or the default one
        memory = (memory or CheckpointOptions(persistent_dir=persistent).resolved_memory_dir()) / f"process_{process}"
    mine = (lambda p: p / f"process_{process}") if process is not None else (lambda p: p)
    return CheckpointOptions(persistent_dir=mine(persistent), memory_dir=memory,
                             peer_dir=mine(Path(c.peer_dir)) if c.peer_dir else None,
                             keep_last=c.keep, keep_every=c.keep_every or None,
                             verify_on_restore=c.verify_on_restore, confined_to=Path(run_dir).absolute(),
                             persistent_format=persistent_format_of(mine(persistent)))


def persistent_format_of(directory: Path) -> str:
    """The format of the persistent tier in `directory`: 'orbax', unless it holds snapshot directories and no orbax
    checkpoint (a process's shards, as the snapshot format held them before they were orbax checkpoints): a run
    that resumes there keeps that format, so that nothing it wrote becomes unreadable."""
    if FileTier(directory, 1).scan()[0] and not OrbaxTier(directory, 1).scan()[0]:
        return "snapshot"
    return "orbax"


def shard_tier(directory: Path, keep: int = 1) -> OrbaxTier | FileTier:
    """The persistent tier of one process's shards (`shard_dirs`), in the format it was written in."""
    return (OrbaxTier if persistent_format_of(directory) == "orbax" else FileTier)(directory, keep)


def training_engine(options: CheckpointOptions, events: EventLog | None = None) -> CheckpointManager:
    """The engine a training run saves through: with the crash tests' fault hook when the environment asks, and
    each state its saves reach as a `checkpoint_state` event in `events` (which step a restart can resume from)."""
    on_state = None if events is None else lambda step, state: events.write("checkpoint_state", step=step,
                                                                             state=state)
    return CheckpointManager(options, fault=faults.from_env(), on_state=on_state)


class TrainCheckpointer:
    """Saves and restores a run's training state through the checkpoint manager: process 0 saves the whole state
    and every process restores the step it chooses; or, `per_process` (an engine whose state is sharded across
    the processes, `TrainEngine.checkpoints_per_process`), every process saves and restores its own shards in
    its own tiers (`process_<p>` directories), and the processes agree on the newest step each of them can
    restore. A run over another set of processes resumes such shards assembled into the whole state."""

    def __init__(self, cfg: Config, run_dir: Path, *, primary: bool, per_process: bool = False,
                 identity: dict[str, Any] | None = None, events: EventLog | None = None):
        self.cfg = cfg
        self.events = events  # where the saves' states go (`training_engine`), if anywhere
        self.identity = identity  # what the run trains on (data/identity.py): recorded in every checkpoint
        self.per_process = per_process
        self.options = checkpoint_options(cfg, run_dir, jax.process_index() if per_process else None)
        self.primary = primary
        self.run_dir = run_dir
        self._claimed: list[Path] = []
        if per_process:  # process 0 makes the run's token first (one shared run directory), then the others
            if primary:
                # The whole-state tier first (a run over other processes may have left checkpoints to resume
                # there; a memory_dir of its own holds the processes' directories, which it would clear as
                # another run's until it is claimed), then this process's own.
                self._claim(checkpoint_options(cfg, run_dir).resolved_memory_dir())
                self._claim(self.options.resolved_memory_dir())
            barrier("angel_jax.checkpoint.claim")
            if not primary:
                self._claim(self.options.resolved_memory_dir())
        elif primary:  # before any restore: other processes restore the step process 0 chooses
            self._claim(self.options.resolved_memory_dir())
        # (a collective where the job copies snapshots over the network: after the claims, which make the run's token)
        network = network_peer(cfg, run_dir, checkpoint_options(cfg, run_dir).resolved_memory_dir(),
                               key=f"process_{jax.process_index()}" if per_process else "whole")
        if network is not None:
            self.options = dataclasses.replace(self.options, peer_network=network)
        self.engine = training_engine(self.options, self.events)
        self.last_handle: SaveHandle | None = None

    # --------------------------------------------------------------------------------------------- saving

    def save(self, step: int, snapshot: StateSnapshot, meta: dict[str, Any]) -> SaveHandle | None:
        """Blocks only for the memory-tier snapshot (for a held snapshot, not even for that: see
        CheckpointManager.save), which is released when the copy is done; None on processes other than 0, which
        release the snapshot at once (unless `per_process`: every process saves its own shards)."""
        if not (self.primary or self.per_process):
            snapshot.release()
            return None
        full = {"step": step, **meta, "seed": self.cfg.train.seed, "config": to_dict(self.cfg),
                **({"identity": self.identity} if self.identity is not None else {})}
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
        are skipped with a warning.

        A run directory can hold checkpoints of three kinds: whole states (written by process 0 of a run whose
        state is whole on every process), every process's own shards (`per_process`, this set of processes), and
        shards of another set of processes (assembled). The kind whose newest committed step is newest is tried
        first, then the others in the same order: a run that changes its number of processes and back resumes
        its newest step, not an older one of its own kind. Within a kind, a damaged step falls back to an older
        one: every process restores the step process 0 chose, or, `per_process`, the newest step whose shards
        every process can restore."""
        # Whole states: this run's own engine, or (`per_process`) the run's whole-state tiers beside its shards,
        # which the engine reshards (written by a run over another set of processes, or by another engine).
        with (CheckpointManager(checkpoint_options(self.cfg, self.run_dir)) if self.per_process
              else contextlib.nullcontext(self.engine)) as whole:
            kinds = [(self._newest_agreed(), self._restore_agreed)] if self.per_process else []
            kinds += [(self._newest_of(whole), lambda: self._restore_newest_of(whole)),
                      (self._newest_shards(), self._restore_assembled)]
            refused: CheckpointError | None = None
            for newest, restore in sorted(kinds, key=lambda kind: -kind[0]):  # stable: own kind first on ties
                if newest < 0:
                    continue
                try:
                    found = restore()
                except CheckpointError as e:  # every step of that kind damaged: another kind may still resume
                    refused = refused or e
                    continue
                if found is not None:
                    return found
            if refused is not None:
                raise refused
        if self.per_process and from_any(self.has_any()):  # shards, but of no step every process has
            raise CheckpointError(
                f"the run in {self.run_dir} has checkpoints of some processes' shards, but no step whose shards "
                "every process has, in its own tiers or in every process_<p> persistent directory: refusing to "
                "start over from step 1 over them (see `angel-jax ckpt ls`; train.resume=false moves them aside)")
        return None

    def _newest_of(self, engine: CheckpointManager) -> int:
        """The newest step committed in `engine`'s tiers (process 0 looks, every process gets it); -1 if none."""
        return from_primary(max((i.step for i in engine.list() if i.committed), default=-1) if self.primary else -1)

    def _restore_newest_of(self, engine: CheckpointManager) -> tuple[int, dict[str, np.ndarray], dict[str, Any],
                                                                    str] | None:
        """The newest valid step of `engine`'s tiers, process 0's choice, on every process."""
        return self._restore_chosen(engine, engine.latest_valid() if self.primary else None,
                                    self.primary and any(i.committed for i in engine.list()))

    def _newest_agreed(self) -> int:
        """`per_process`: the newest step committed in every process's own tiers; -1 if none (a collective)."""
        committed = [i.step for i in self.engine.list() if i.committed]
        return max(set.intersection(*map(set, every_process_lists(sorted(committed, reverse=True)))), default=-1)

    def _newest_shards(self) -> int:
        """The newest step committed in every `process_<p>` persistent directory (process 0 looks); -1 if none."""
        return from_primary((shard_steps(self.run_dir) or [-1])[0] if self.primary else -1)

    def _restore_assembled(self) -> tuple[int, dict[str, Any], dict[str, Any], str] | None:
        """The newest step committed in every `process_<p>` persistent directory whose shards all verify,
        assembled (process 0 chooses; a damaged step is skipped with a warning); None when there is none."""
        chosen, mine = -1, None
        steps = shard_steps(self.run_dir) if self.primary else []
        if steps:
            try:
                mine = assemble_newest(self.run_dir, steps, self.cfg.checkpoint.keep)
                chosen = mine[0]
            except CheckpointError:
                chosen = ALL_DAMAGED
        chosen = from_primary(chosen)
        if chosen == ALL_DAMAGED:
            raise CheckpointError(f"every step of the process shards in {self.run_dir / 'checkpoints'} is damaged or "
                                  "incomplete (see the warnings above): refusing to start over from step 1 over them")
        if chosen < 0:
            return None
        return mine if mine is not None else assemble_shards(self.run_dir, chosen, self.cfg.checkpoint.keep)

    def _restore_chosen(self, engine: CheckpointManager, ref: Any, has_any: bool
                        ) -> tuple[int, dict[str, np.ndarray], dict[str, Any], str] | None:
        """Restore, on every process, the step process 0 found valid (`ref`; `has_any`: whether it has any)."""
        chosen = ref.step if ref else (ALL_DAMAGED if has_any else -1)
        chosen = from_primary(chosen)
        if chosen == ALL_DAMAGED:
            # Starting over would overwrite the run's metrics and, at its first save, its checkpoints (through a
            # symlinked checkpoints/, another run's).
            refused = engine.refusals()
            what = f"damaged or may not be loaded (first: {refused[0]})" if refused else "damaged"
            raise CheckpointError(
                f"every checkpoint of the run in {self.run_dir} is {what} (see the warnings above, or `angel-jax "
                f"ckpt verify {self.run_dir}`): refusing to start over from step 1 over it. To train afresh anyway, "
                "set train.resume=false (the checkpoints are moved aside, not deleted)")
        if chosen < 0:
            return None
        restored = engine.restore(chosen)
        return restored.step, restored.arrays, dict(restored.meta), restored.source

    def _restore_agreed(self) -> tuple[int, dict[str, np.ndarray], dict[str, Any], str] | None:
        """`per_process`: the newest step every process restores its own shards of (each process tries the steps
        committed in all of them, newest first, and all go on to the next older one unless every one succeeded);
        None when no step is committed in all of them. When there are such steps and none restores, refused as
        every checkpoint damaged is without `per_process`."""
        committed = sorted((i.step for i in self.engine.list() if i.committed), reverse=True)
        common = sorted(set.intersection(*map(set, every_process_lists(committed))), reverse=True)
        for step in common:
            try:
                restored, ok = self.engine.restore(step), True
            except CheckpointError as e:
                restored, ok = None, False
                log.warning("step %d: this process's shards cannot be restored (%s)", step, e)
            if not from_any(not ok):
                assert restored is not None
                return restored.step, restored.arrays, dict(restored.meta), restored.source
            log.warning("step %d cannot be restored by every process: trying an older one", step)
        if common:
            raise CheckpointError(
                f"no step of the run in {self.run_dir} has shards every process can restore (see the warnings "
                "above, or `angel-jax ckpt verify` on each process_<p> directory): refusing to start over from "
                "step 1 over them. To train afresh anyway, set train.resume=false (they are moved aside)")
        return None

    def persisted(self, step: int) -> bool:
        """Whether `step` is committed in the persistent tier (process 0 looks, or every process for its own
        shards; every process gets the answer)."""
        found = False
        if self.primary or self.per_process:
            tiers = {i.step: i.tiers for i in self.engine.list()}.get(step, {})
            found = "persistent" in tiers and tiers["persistent"].state == "persisted"
        if self.per_process:
            return not from_any(not found)
        return bool(from_primary(int(found)))

    def archive_existing(self) -> Path | None:
        """Move every tier's checkpoints of this run aside (train.resume=false): the new run owns the run
        directory's checkpoints, and nothing of the old run is deleted. Returns the archive directory. Every process
        moves its own shards' tiers aside (`per_process`; process 0 also the whole-state checkpoints a run over
        other processes left); otherwise process 0 moves the run's tiers, with the `process_<p>` directories in
        them."""
        if not (self.primary or self.per_process):
            return None
        if self.per_process and self.primary:
            self._archive_whole_state()
        if not (self.has_any() or (not self.per_process and shard_dirs(self.run_dir))):
            return None
        if isinstance(self.engine.peer, NetworkPeerTier):  # copies on other nodes cannot be moved aside: removed
            self.engine.peer.discard_everywhere()
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
        self.engine = training_engine(self.options, self.events)
        return archive

    def _archive_whole_state(self) -> None:
        """`per_process`: the whole-state checkpoints in the run's tiers moved aside, each tier's `process_<p>`
        directories (the processes' own, which each of them moves) left where they are."""
        options = checkpoint_options(self.cfg, self.run_dir)
        with CheckpointManager(options) as whole:
            if not any(i.committed for i in whole.list()):
                return
        archive = options.persistent_dir.with_name(
            f"{options.persistent_dir.name}.replaced-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")
        for tier, root in (("persistent", options.persistent_dir), ("memory", options.resolved_memory_dir()),
                           ("peer", options.peer_dir)):
            if root is None or not root.is_dir():
                continue
            for child in root.iterdir():
                if PROCESS_DIR.fullmatch(child.name) or child.name == OWNER_FILE:
                    continue
                (archive / tier).mkdir(parents=True, exist_ok=True)
                shutil.move(str(child), str(archive / tier / child.name))
        log.warning("train.resume=false: the run directory's earlier whole-state checkpoints were moved to %s",
                    archive)

    def _claim(self, memory_root: Path) -> None:
        self._claimed.append(memory_root)  # (first: a refusal below may have locked nothing, releasing is harmless)
        claim_memory_tier(self.run_dir, memory_root)

    def close(self) -> None:
        """Waits for background saves (the last checkpoint is committed before the process moves on), then lets
        go of the memory tiers."""
        try:
            self.engine.close()
        finally:
            for root in self._claimed:
                release_memory_tier(root)


def shard_steps(run_dir: Path) -> list[int]:
    """The steps committed in the persistent tier of every `process_<p>` directory of the run's checkpoints
    (written by a run whose processes each checkpointed their own shards), newest first."""
    dirs = shard_dirs(run_dir)
    if not dirs:
        return []
    return sorted(set.intersection(*(set(trusted_steps(d)) for d in dirs.values())), reverse=True)


def trusted_steps(directory: Path) -> list[int]:
    """The steps committed in one process's shard directory whose directories may be loaded (each other one named
    once in a warning)."""
    steps = []
    for step, path in shard_tier(directory).scan()[0].items():
        if reason := untrusted(path, within=directory):
            _warn_once(f"checkpoint step {step} of the shards in {directory} ({path}) {reason}: not loaded")
        else:
            steps.append(step)
    return steps


def shard_dirs(run_dir: Path) -> dict[int, Path]:
    """process -> the persistent tier of its shards, for every `process_<p>` directory of the run's checkpoints
    that may be loaded (`trust.untrusted`: another user's, or reached through a symlink out of the run directory,
    is left out with a warning)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return {}
    found = {}
    for child in root.iterdir():
        if (m := PROCESS_DIR.fullmatch(child.name)) and child.is_dir():
            if reason := untrusted(child, root=True, within=Path(run_dir)):
                _warn_once(f"the shards of process {m.group(1)} in {child} {reason}: not loaded")
            else:
                found[int(m.group(1))] = child
    return found


_WARNED: set[str] = set()


def _warn_once(text: str) -> None:
    """A refusal logged once per process, however often the run's directories are listed."""
    if text not in _WARNED:
        _WARNED.add(text)
        log.warning("%s", text)


def assemble_newest(run_dir: Path, steps: list[int], keep: int = 1
                    ) -> tuple[int, dict[str, Any], dict[str, Any], str]:
    """The first of `steps` (newest first) whose every process's shards verify, assembled (`assemble_shards`); a
    damaged or incomplete step is skipped with a warning. CheckpointError naming every problem when none is."""
    problems = []
    for step in steps:
        try:
            return assemble_shards(run_dir, step, keep)
        except CheckpointError as e:
            log.warning("%s; trying an older step", e)
            problems.append(str(e))
    raise CheckpointError(f"no step of the process shards in {Path(run_dir) / 'checkpoints'} can be assembled: "
                          + "; ".join(problems or ["there is none"]))


def assemble_shards(run_dir: Path, step: int, keep: int = 1) -> tuple[int, dict[str, Any], dict[str, Any], str]:
    """The whole state of `step` from every process's shards of it (their persistent tiers), for a run over
    another set of processes: (step, arrays, meta, tier). The meta is process 0's, without what describes its
    shards. The paged engine's pages are the processes' rank shards end to end; the in-memory engine's leaves are
    its pieces put in place (`pieces` in its meta); either way `LazyArray`s, assembled from the files' mapped
    views as they are read, one array in memory at a time. The other arrays are process 0's. Needs every process's
    persistent directory (a shared file system)."""
    parts: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}  # process -> (arrays, engine meta)
    meta0: dict[str, Any] = {}
    for process, directory in sorted(shard_dirs(run_dir).items()):
        if step not in trusted_steps(directory):
            raise CheckpointError(f"step {step}: the shards of process {process} ({directory}) have no step {step} "
                                  "that may be loaded (see the warnings above)", step=step, stage="restore")
        try:
            index, arrays = shard_tier(directory, keep).load(step, verify=True, pool=None)
        except SnapshotDamaged as e:
            raise CheckpointError(f"step {step}: the shards of process {process} ({directory}) are damaged: "
                                  f"{'; '.join(e.problems)}. The state cannot be assembled without them",
                                  step=step, stage="restore") from None
        parts[process] = (arrays, dict(index.meta.get("engine", {})))
        meta0 = dict(index.meta) if process == 0 else meta0
    fmt = format_of(parts[min(parts)][1]) if parts else None
    try:
        counts = {p: fmt.processes(engine) for p, (_, engine) in parts.items()}
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"step {step}: {e}", step=step, stage="restore") from None
    if len(set(counts.values())) != 1 or sorted(parts) != list(range(next(iter(counts.values())))):
        raise CheckpointError(f"step {step}: the run's checkpoints hold the shards of processes {sorted(parts)}, "
                              f"of a run over {sorted(set(counts.values()))} processes: some process's shards are "
                              "missing", step=step, stage="restore")
    log.warning("assembling the checkpoint of step %d from the shards of the %d processes that wrote it (this run "
                "has %d): from the persistent tier", step, len(parts), jax.process_count())
    engine0 = parts[0][1]
    whole = fmt.assemble(parts)
    meta0["engine"] = {k: v for k, v in engine0.items() if k not in ("shards", "pieces", "process")}
    return step, whole, meta0, f"persistent (the shards of {len(parts)} processes)"
