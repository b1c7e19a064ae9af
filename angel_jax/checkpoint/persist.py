"""The persistent tier: one ordinary orbax checkpoint per step, written from a memory-tier snapshot.

Layout (what `orbax.checkpoint.CheckpointManager` itself writes, so plain orbax reads it):

    <persistent_dir>/<step>/_CHECKPOINT_METADATA
    <persistent_dir>/<step>/state/   the arrays: a flat dict {name: np.ndarray} (tensorstore, OCDBT), written by the
                                     process that holds them (orbax_local.py: each process of a multi-process run
                                     may persist its own shards in a directory of its own)
    <persistent_dir>/<step>/meta/    JSON: the snapshot index (format, step, user meta, dtype/shape/xxh3_64 per array)

Reading it with nothing but orbax:

    import orbax.checkpoint as ocp
    mngr = ocp.CheckpointManager("/path/to/persistent_dir")
    ckpt = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(),
                                                      meta=ocp.args.JsonRestore()))
    ckpt.state["w"]            # np.ndarray;  ckpt.meta["meta"] is the user meta
    xxhash.xxh3_64_intdigest(ckpt.state["w"].tobytes()) == {a["name"]: a["xxh3_64"] for a in ckpt.meta["arrays"]}["w"]

Orbax refuses zero-size arrays, so empty arrays are not in `state`: their dtype and shape are in `meta.arrays`
(nbytes 0), and restore rebuilds them. A step with only empty arrays has no `state` item.

A state larger than half the RAM available (`OrbaxTier.stream_above`) is restored as it is consumed: `load`
returns `LazyArray`s, and the arrays are read with orbax's partial restore in groups of about `CHUNK_BYTES`, in
the order of the index (the order the engines load them), each group let go as its arrays are taken. With
`verify`, every group is first read and checksummed once before `load` returns, so a damaged copy is still
rejected before any of it reaches the engine (the reading costs twice the I/O, never the memory).

Commit is orbax's: it writes `<step>.orbax-checkpoint-tmp*/` and renames it to `<step>/` when complete (POSIX
file systems), with the meta (and so the checksums) in the same directory, so they commit together. A directory
with the tmp suffix is never read and is removed after a failed save or by the next writer.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import sys
import threading
import time
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, Iterator, Mapping

import dataclasses

import jax
import numpy as np
import orbax.checkpoint as ocp
import psutil

from angel_jax.checkpoint.faults import Fault, no_fault
from angel_jax.checkpoint.orbax_local import state_handler
from angel_jax.checkpoint.snapshot import (ArrayEntry, Select, SnapshotDamaged, SnapshotIndex, check_named_step,
                                           decode_dtype, open_arrays, remove_dir, selected, verify_arrays)
from angel_jax.checkpoint.state import LazyArray
from angel_jax.checkpoint.tiers import Committed, CopyTier

STATE_ITEM = "state"
META_ITEM = "meta"
_STEP_RE = re.compile(r"^(\d+)$")
_TMP_RE = re.compile(r"^(\d+)\.orbax-checkpoint-tmp.*$")
CHUNK_BYTES = 1 << 30
"""A streamed restore reads groups of arrays of about this many bytes per orbax call."""
_DISCARD_WAIT_S = 10.0
"""At most this long to clear what a failed save left while its last writes drain."""


class OrbaxTier(CopyTier):
    """Saves, lists, loads and checks orbax checkpoints under `root`. Thread-safe (one orbax call at a time)."""

    name = "persistent"
    committed_state = "persisted"
    stage = "persist"
    best_effort = False

    stream_above: int | None = None
    """States of more bytes than this are restored as they are consumed (None: half the RAM available)."""

    def __init__(self, root: Path, keep_last: int, keep_every: int | None = None, *, fault: Fault = no_fault):
        super().__init__(root, keep_last, keep_every)
        self._fault = fault
        # One orbax call at a time (checkpointers keep per-call state), and no cleanup racing a save in progress.
        self._lock = threading.RLock()

    def _checkpointer(self, step: int, *, saving: bool = False) -> ocp.Checkpointer:
        """A synchronous orbax Checkpointer (we already run in a background thread) with one fault-injection point
        between "all data written" and orbax's commit. Patched on the instance: orbax finds a handler's args class
        by its type, so a subclass would not be recognised. `saving`: the state item is written by the calling
        process whichever it is (orbax_local.py), saved with PyTreeSave; reading uses orbax's default handlers."""
        # In a multi-process run each process writes its own checkpoints (process 0 the whole state, or every
        # process its own shards) and reads on its own: every orbax barrier is local to the calling process, or a
        # save by one process would wait for the others. And directories are created before the items are written,
        # not signalled: orbax's signals are keyed by an operation count that every process keeps (its saves are
        # meant to be collective), so two processes saving on their own would take each other's "directory
        # created" for their own and write into directories that do not exist yet.
        me = jax.process_index()
        mp = (ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me},
                                                 barrier_sync_key_prefix=f"angel_jax_process_{me}")
              if jax.process_count() > 1 else ocp.options.MultiprocessingOptions())
        items = ({STATE_ITEM: state_handler(mp), META_ITEM: ocp.JsonCheckpointHandler(multiprocessing_options=mp)}
                 if saving else {})
        handler = ocp.CompositeCheckpointHandler(
            composite_options=ocp.CompositeOptions(
                multiprocessing_options=mp,
                async_options=ocp.options.AsyncOptions(create_directories_asynchronously=False)),
            **items)
        finalize = handler.finalize

        def finalize_with_fault_point(directory):  # noqa: ANN001, ANN202 - orbax's signature
            self._fault("persist.commit", step)
            return finalize(directory)

        handler.finalize = finalize_with_fault_point
        return ocp.Checkpointer(handler, multiprocessing_options=mp)

    # ------------------------------------------------------------------------------------------- listing

    def scan(self) -> tuple[dict[int, Path], dict[int, Path]]:
        """(committed, partial) step directories; partial = orbax tmp directories of unfinished saves."""
        committed: dict[int, Path] = {}
        partial: dict[int, Path] = {}
        if not self.root.is_dir():
            return committed, partial
        for child in self.root.iterdir():
            if (m := _STEP_RE.match(child.name)) and child.is_dir():
                committed[int(m.group(1))] = child
            elif m := _TMP_RE.match(child.name):
                partial[int(m.group(1))] = child
        return committed, partial

    def remove_partial(self, step: int | None = None) -> None:
        """Deletes unfinished orbax tmp directories (all, or one step's): they hold space and are never read."""
        with self._lock:
            for s, path in self.scan()[1].items():
                if step is None or s == step:
                    remove_dir(path)

    def _discard_failed(self, step: int, target: Path) -> None:
        """Removes what a failed save left, until nothing of it comes back.

        When one array's write fails, orbax raises while the writes of other arrays may still be in flight and
        recreate files after a first removal (seen on a full disk under load). The target did not exist before
        the save (a re-save writes to a side name), so whatever is there is this save's, possibly already renamed
        from orbax's tmp name when a late write failed: left behind, it would look committed."""
        deadline, quiet = time.monotonic() + _DISCARD_WAIT_S, 0
        while quiet < 3 and time.monotonic() < deadline:
            self.remove_partial(step)
            remove_dir(target)
            time.sleep(0.05)
            left = target.exists() or step in self.scan()[1]
            quiet = 0 if left else quiet + 1

    def delete(self, step: int) -> None:
        remove_dir(self.root / str(step))

    # ------------------------------------------------------------------------------------------- saving

    def copy_from(self, source: Committed) -> Path:
        """Persists a committed memory-tier snapshot, read through read-only views of its file."""
        _, views = open_arrays(source.path, private=False)
        return self.save(source.index, views)

    def save(self, index: SnapshotIndex, arrays: Mapping[str, np.ndarray]) -> Path:
        """Writes and commits step `index.step`; on any error the partial directory is removed and the error raised.

        `arrays` are the snapshot's read-only views: persistence never touches the trainer's live arrays.
        An existing committed copy of the same step is replaced only after the new one is complete.
        """
        step = index.step
        items = {META_ITEM: ocp.args.JsonSave(index.to_json())}
        state = {a.name: arrays[a.name] for a in index.arrays if a.nbytes > 0}
        if state:
            items[STATE_ITEM] = ocp.args.PyTreeSave(state)
        final = self.root / str(step)
        # A re-save of a step (after a rollback) goes to a side name first, so the old copy survives a failure.
        target = final if not final.exists() else self.root / f"{step}.orbax-checkpoint-tmp-resave"
        _quiet_late_callbacks()
        with self._lock, _orbax_thread_errors.muted():
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)  # private, as the memory tier
            self.remove_partial()  # one writer: any unfinished save is garbage holding space
            try:
                self._checkpointer(step, saving=True).save(target, args=ocp.args.Composite(**items))
            except BaseException:
                self._discard_failed(step, target)
                raise
            if target != final:  # swap in the new copy; a crash between the renames leaves the memory tier's copy
                old = self.root / f"{step}.orbax-checkpoint-tmp-old"
                remove_dir(old)
                final.rename(old)
                target.rename(final)
                remove_dir(old)
        return final

    # ------------------------------------------------------------------------------------------- reading

    def load(self, step: int, *, verify: bool, pool: Executor | None,
             select: Select | None = None) -> tuple[SnapshotIndex, dict[str, np.ndarray]]:
        """The arrays and index of a committed step (the arrays `select` keeps: the others are neither read nor
        verified, through orbax's partial restore); raises SnapshotDamaged naming what is wrong."""
        path = self.root / str(step)
        if not path.is_dir():
            raise SnapshotDamaged([f"{path}: missing"])
        index = self._read_index(path)
        _quiet_late_callbacks()
        chosen = selected(index, select)
        limit = self.stream_above if self.stream_above is not None else psutil.virtual_memory().available // 2
        if sum(a.nbytes for a in chosen.arrays) > limit:
            return index, self._load_streaming(path, chosen, verify, pool)
        if select is not None:
            return index, self._load_some(path, chosen, verify, pool)
        items = {META_ITEM: ocp.args.JsonRestore()}
        if any(a.nbytes for a in index.arrays):
            items[STATE_ITEM] = ocp.args.StandardRestore()
        try:
            with self._lock:
                restored = self._checkpointer(step).restore(path, args=ocp.args.Composite(**items))
        except Exception as e:  # tensorstore/orbax raise many types for corrupt or missing files
            raise SnapshotDamaged([f"{path}: orbax restore failed: {type(e).__name__}: {_short(e)}"]) from None
        state = dict(restored[STATE_ITEM]) if STATE_ITEM in items else {}
        arrays = {}
        for a in index.arrays:
            if a.nbytes == 0:
                arrays[a.name] = np.zeros(a.shape, decode_dtype(a.dtype))
            elif a.name in state:
                arrays[a.name] = np.asarray(state[a.name])
        problems = verify_arrays(index, arrays, pool, str(path)) if verify else []
        if problems:
            raise SnapshotDamaged(problems)
        return index, arrays

    def _load_streaming(self, path: Path, index: SnapshotIndex, verify: bool,
                        pool: Executor | None) -> dict[str, np.ndarray | LazyArray]:
        reader = _GroupReader(self, path, index)
        if verify:
            for group in reader.groups:
                arrays = reader.restore(group)
                problems = verify_arrays(dataclasses.replace(index, arrays=group), arrays, pool, str(path))
                if problems:
                    raise SnapshotDamaged(problems)
                del arrays
        out: dict[str, np.ndarray | LazyArray] = {}
        for a in index.arrays:
            out[a.name] = np.zeros(a.shape, decode_dtype(a.dtype)) if a.nbytes == 0 else \
                LazyArray(a.shape, decode_dtype(a.dtype), lambda name=a.name: reader.take(name))
        return out

    def _load_some(self, path: Path, chosen: SnapshotIndex, verify: bool,
                   pool: Executor | None) -> dict[str, np.ndarray]:
        """The arrays of `chosen` (part of a step), read a group at a time with orbax's partial restore."""
        arrays = {a.name: np.zeros(a.shape, decode_dtype(a.dtype)) for a in chosen.arrays if a.nbytes == 0}
        for group in _GroupReader(self, path, chosen).groups:
            arrays.update(self._restore_some(path, group))
        problems = verify_arrays(chosen, arrays, pool, str(path)) if verify else []
        if problems:
            raise SnapshotDamaged(problems)
        return arrays

    def _restore_some(self, path: Path, group: tuple[ArrayEntry, ...]) -> dict[str, np.ndarray]:
        """Some of a committed step's arrays (orbax partial restore)."""
        item = {a.name: np.zeros((), decode_dtype(a.dtype)) for a in group}
        args = {a.name: ocp.RestoreArgs(restore_type=np.ndarray) for a in group}
        try:
            with self._lock:
                restored = self._checkpointer(-1).restore(path, args=ocp.args.Composite(**{
                    STATE_ITEM: ocp.args.PyTreeRestore(item=item, restore_args=args, partial_restore=True)}))
        except Exception as e:  # noqa: BLE001 - as in `load`
            raise SnapshotDamaged([f"{path}: orbax restore failed: {type(e).__name__}: {_short(e)}"]) from None
        state = restored[STATE_ITEM]
        missing = [a.name for a in group if a.name not in state]
        if missing:
            raise SnapshotDamaged([f"{path}: array {missing[0]!r} missing"])
        return {a.name: np.asarray(state[a.name]).reshape(a.shape) for a in group}

    def check(self, step: int, pool: Executor | None) -> list[str]:
        try:
            self.load(step, verify=True, pool=pool)
        except SnapshotDamaged as e:
            return e.problems
        return []

    def read_index(self, step: int) -> SnapshotIndex:
        return self._read_index(self.root / str(step))

    @staticmethod
    def _read_index(path: Path) -> SnapshotIndex:
        meta_file = path / META_ITEM / "metadata"  # where orbax's JsonCheckpointHandler puts the JSON
        try:
            index = SnapshotIndex.from_json(json.loads(meta_file.read_text()))
        except FileNotFoundError:
            raise SnapshotDamaged([f"{meta_file}: missing"]) from None
        except (ValueError, KeyError, TypeError) as e:
            raise SnapshotDamaged([f"{meta_file}: unreadable ({e})"]) from None
        check_named_step(path, index, int(path.name) if path.name.isdigit() else None)
        return index


class _GroupReader:
    """A committed step's arrays read on demand, a group of about CHUNK_BYTES at a time (in index order); an array
    taken is let go, and the group with it once all of its arrays are taken."""

    def __init__(self, tier: OrbaxTier, path: Path, index: SnapshotIndex):
        self._tier, self._path = tier, path
        groups: list[list[ArrayEntry]] = [[]]
        size = 0
        for a in index.arrays:
            if a.nbytes == 0:
                continue
            if groups[-1] and size + a.nbytes > CHUNK_BYTES:
                groups.append([])
                size = 0
            groups[-1].append(a)
            size += a.nbytes
        self.groups = [tuple(g) for g in groups if g]
        self._group_of = {a.name: g for g in self.groups for a in g}
        self._held: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()

    def restore(self, group: tuple[ArrayEntry, ...]) -> dict[str, np.ndarray]:
        return self._tier._restore_some(self._path, group)

    def take(self, name: str) -> np.ndarray:
        with self._lock:
            if name not in self._held:  # its group, read afresh (an array taken twice is read twice)
                self._held = self.restore(self._group_of[name])
            return self._held.pop(name)


_quieted = False


def _quiet_late_callbacks() -> None:
    """When a restore fails on a damaged file, or a save on a full disk, orbax's event loop closes while
    tensorstore's other reads or writes are still in flight; as each completes, its callback raises "Event loop is
    closed" into `sys.unraisablehook`, a traceback on stderr apiece (15 for one damaged checkpoint of 20 arrays,
    about 30 for one save on a full disk) about nothing lost: the failure itself is reported, on one line, as the
    damage or the failed persist it is. This drops exactly those and passes everything else to the hook before it.
    Installed once, on the first read or save."""
    global _quieted
    if _quieted:
        return
    _quieted = True
    before = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        e = unraisable.exc_value
        if isinstance(e, RuntimeError) and str(e) == "Event loop is closed":
            return
        before(unraisable)

    sys.unraisablehook = hook


class _MutedThreadErrors(logging.Filter):
    """Drops orbax's log of an exception in one of its save threads ("_SignalingThread.run() raised an
    exception", a traceback apiece, two per failed save) while one of our saves runs: orbax raises the same
    exception from the save call, and the engine reports it on one line with the failed persist."""

    MESSAGE = "_SignalingThread.run() raised an exception"

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self.saving = 0
        """Saves in progress in this process (each engine's worker saves on its own thread)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (self.saving and self.MESSAGE in str(record.msg))

    @contextlib.contextmanager
    def muted(self) -> Iterator[None]:
        with self._lock:
            if self.saving == 0 and self not in logging.getLogger("absl").filters:
                logging.getLogger("absl").addFilter(self)  # orbax logs through absl's logger
            self.saving += 1
        try:
            yield
        finally:
            with self._lock:
                self.saving -= 1


_orbax_thread_errors = _MutedThreadErrors()


def _short(e: BaseException, limit: int = 300) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[:limit] + "..."
