"""CheckpointEngine: the stateful shell around the snapshot format, the memory-tier writer and the orbax tier.

A save, in order:

    save()  [blocks]   copy every array into memory_dir/step_<k>.tmp/data.bin              state "copied"
    worker             XXH3-64 of the copy, index.json, rename to step_<k>/  (the commit) state "snapshotted"
    worker             copy to peer_dir/step_<k>/ (tmp + fsync + rename)                  state "backed_up"
    worker             orbax save of the snapshot's bytes to persistent_dir/<k>/          state "persisted"
    worker             retention in every tier

`save(..., hold=True)` moves the copy itself off the training thread too: the engine only takes references to the
arrays, and the worker copies them into the memory tier, then sets `handle.released`. The caller promises that the
arrays stay unchanged and alive until then: for jax arrays (immutable) that means not donating or deleting them,
which the in-memory train engine does by running its step without donation while a held save is copying. The
training stall is then the time to hand over references (microseconds), at the price of the arrays' memory being
kept until the copy is done. Without `hold` (numpy arrays that the caller updates in place, such as host pages),
save() copies before it returns.

Why the checksum is not in the blocking part: hashing is cheap (XXH3-64, ~11 GB/s per core here) but not free, and
it is computed from the snapshot (never the live arrays). A snapshot only gets its committed name after its
checksums are written, so every committed checkpoint in every tier carries them. The price: a crash between save()
returning and the commit loses that snapshot, and restore falls back to the previous one.

Work for a step whose persistence has not started when a newer save arrives is skipped ("superseded", except steps
kept by keep_every): the memory tier has it, and persisting an older state behind a newer one only delays the newer.
Errors of background work are kept and surfaced once, by poll_errors() or wait(); training is never interrupted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import numpy as np

from angel_jax.checkpoint import snapshot as snap
from angel_jax.checkpoint.checksum import digest_many
from angel_jax.checkpoint.faults import fault_point
from angel_jax.checkpoint.memtier import MemoryTierFull, SnapshotWriter
from angel_jax.checkpoint.options import CheckpointOptions
from angel_jax.checkpoint.persist import OrbaxTier
from angel_jax.checkpoint.records import (TIERS, CheckpointError, CheckpointInfo, CheckpointRef, Restored, Tier,
                                          TierState)
from angel_jax.checkpoint.retention import steps_to_keep

log = logging.getLogger(__name__)

_TERMINAL = ("persisted", "superseded", "failed")


class SaveHandle:
    """Progress of one save: copied -> snapshotted -> [backed_up ->] persisted | superseded | failed."""

    def __init__(self, step: int, released: threading.Event | None = None):
        self.step = step
        self.stall_s = 0.0
        self.timings: dict[str, float] = {}  # ckpt/... metric names -> seconds
        self.errors: list[CheckpointError] = []
        self._state = "copied"
        self._done = threading.Event()
        self.released = released if released is not None else threading.Event()
        """Set once the engine no longer needs the caller's arrays (at return, or after a held save's copy)."""

    @property
    def state(self) -> str:
        return self._state

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> str:
        """Waits until the save reaches a final state and returns it (errors stay in `errors` / the engine)."""
        self._done.wait(timeout)
        return self._state

    def _advance(self, state: str) -> None:
        self._state = state
        if state in _TERMINAL:
            self._done.set()

    def __repr__(self) -> str:
        return f"SaveHandle(step={self.step}, state={self._state!r}, stall_s={self.stall_s:.4f})"


@dataclass
class _Job:
    step: int
    index: snap.SnapshotIndex
    tmp: Path | None
    """The snapshot's .tmp directory; None until a held save's arrays are copied."""
    handle: SaveHandle
    started: float
    held: dict[str, Any] | None = None
    """A held save's arrays, until the worker has copied them."""
    extra: dict[str, Any] = field(default_factory=dict)


class CheckpointEngine:
    """Saves to memory first, persists in the background, restores from the fastest valid tier."""

    def __init__(self, options: CheckpointOptions, *, clock: Callable[[], float] = time.monotonic):
        self.options = options
        self._clock = clock
        self._memory_root = options.resolved_memory_dir()
        self._persistent = OrbaxTier(options.persistent_dir)
        self._lock = threading.Condition()  # guards the queue, the pins and every rename/delete in the memory tier
        self._queue: deque[_Job] = deque()
        self._pinned: set[int] = set()  # steps whose snapshot the background work still needs
        self._errors: list[CheckpointError] = []
        self._worker: threading.Thread | None = None
        self._checksum_pool: ThreadPoolExecutor | None = None
        self._writer: SnapshotWriter | None = None
        self._cleaned = False
        self._closed = False

    # ------------------------------------------------------------------------------------------- lazy resources

    def _pool(self) -> ThreadPoolExecutor | None:
        """Threads that hash arrays (xxhash releases the GIL on large buffers)."""
        if self.options.io_threads > 1 and self._checksum_pool is None:
            self._checksum_pool = ThreadPoolExecutor(self.options.io_threads, thread_name_prefix="ckpt-hash")
        return self._checksum_pool

    def _snapshot_writer(self) -> SnapshotWriter:
        if self._writer is None:
            self._writer = SnapshotWriter(self._memory_root)
        return self._writer

    # ------------------------------------------------------------------------------------------- saving

    def save(self, step: int, arrays: Mapping[str, np.ndarray | jax.Array], meta: dict[str, Any], *,
             hold: bool = False, released: threading.Event | None = None) -> SaveHandle:
        """Snapshots `arrays` into the memory tier and returns; the rest happens in the background.

        Without `hold`, the arrays may be modified, donated or deleted as soon as this returns. With `hold`, the
        copy into the memory tier happens in the background as well, and the caller must keep the arrays unchanged
        and alive until `handle.released` is set (the caller's own Event when `released` is given). Bad input (non-JSON meta, object dtypes, a negative step)
        raises here, before anything is written. If the memory tier is full or unusable, the state is persisted
        directly (blocking, or in the background with `hold`) with a warning.
        """
        if self._closed:
            raise CheckpointError("engine is closed", step=step, stage="save")
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        started = self._clock()
        index = snap.plan_layout(step, arrays, meta)
        handle = SaveHandle(step, released)
        with self._lock:
            while step in self._pinned:  # the same step again while its previous save is in flight: let it finish
                self._lock.wait()
            self._pinned.add(step)
        if hold:
            for x in arrays.values():  # start device-to-host transfers now; the worker waits for them
                if isinstance(x, jax.Array):
                    x.copy_to_host_async()
            job = _Job(step, index, None, handle, started, held=dict(arrays))
        else:
            host = _to_host(arrays)
            try:
                tmp = self._write_snapshot(step, index, host)
            except MemoryTierFull as e:
                log.warning("checkpoint step %d: %s; persisting directly (blocking) instead", step, e)
                self._persist_directly(index, host, handle)
                with self._lock:
                    self._pinned.discard(step)
                    self._lock.notify_all()
                handle.stall_s = handle.timings["ckpt/stall_s"] = self._clock() - started
                handle.released.set()
                return handle
            except BaseException:
                with self._lock:
                    self._pinned.discard(step)
                    self._lock.notify_all()
                raise
            handle.released.set()
            job = _Job(step, index, tmp, handle, started)
        handle.stall_s = handle.timings["ckpt/stall_s"] = self._clock() - started
        with self._lock:
            self._queue.append(job)
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="ckpt-persist", daemon=False)
                self._worker.start()
            self._lock.notify_all()
        return handle

    def _copy_held(self, job: "_Job") -> bool:
        """The background half of a held save: copy the arrays into the memory tier, then release them. Returns
        False when the memory tier could not take them and the state was persisted directly instead."""
        t0 = self._clock()
        try:
            host = _to_host(job.held)
            try:
                job.tmp = self._write_snapshot(job.step, job.index, host)
            except MemoryTierFull as e:
                log.warning("checkpoint step %d: %s; persisting directly instead", job.step, e)
                self._persist_directly(job.index, host, job.handle)
                return False
            finally:
                del host
        finally:
            job.held = None
            job.handle.released.set()
            job.handle.timings["ckpt/copy_s"] = self._clock() - t0
        return True

    def _write_snapshot(self, step: int, index: snap.SnapshotIndex, host: Mapping[str, np.ndarray]) -> Path:
        writer = self._snapshot_writer()
        with self._lock:
            committed, partial = snap.scan(self._memory_root)
            keep = steps_to_keep([*committed, step], self.options.keep_last)
            victims = [p for s, p in sorted(committed.items()) if s not in keep and s not in self._pinned]
            victims += [p for s, p in partial.items() if s not in self._pinned or s == step]
            try:
                tmp = writer.prepare(step, index, victims)
            except MemoryTierFull:
                raise
            except OSError as e:  # e.g. memory_dir not creatable: same fallback as a full tier
                raise MemoryTierFull(e.errno, f"memory tier {self._memory_root}: {e}") from e
        writer.copy(tmp, index, host, after_first=lambda: fault_point("snapshot.copy", step))
        return tmp

    def _persist_directly(self, index: snap.SnapshotIndex, host: Mapping[str, np.ndarray], handle: SaveHandle) -> None:
        t0 = self._clock()
        try:
            index = index.with_checksums(digest_many([_bytes_view(host[a.name]) for a in index.arrays], self._pool()))
            self._persistent.save(index, host)
        except Exception as e:  # noqa: BLE001 - every failure is surfaced, never swallowed
            self._record(handle, CheckpointError(f"checkpoint step {index.step}: persist failed (direct): {e}",
                                                 step=index.step, stage="persist"), cause=e)
            handle._advance("failed")
            return
        handle.timings["ckpt/persist_s"] = self._clock() - t0
        handle._advance("persisted")
        try:
            self._retain()
        except Exception as e:  # noqa: BLE001
            self._record(handle, CheckpointError(f"retention after step {index.step}: {e}", step=index.step,
                                                 stage="retention"), cause=e)

    # ------------------------------------------------------------------------------------------- background

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._worker = None
                    self._lock.notify_all()
                    return
                job = self._queue[0]
            try:
                self._background(job)
            except Exception as e:  # noqa: BLE001
                stage = job.extra.get("stage", "background")
                self._record(job.handle, CheckpointError(f"checkpoint step {job.step}: {stage} failed: {e}",
                                                         step=job.step, stage=stage), cause=e)
                job.handle._advance("failed")
            finally:
                job.held = None
                job.handle.released.set()  # also when the copy failed: the caller's arrays are free either way
                with self._lock:
                    self._queue.popleft()
                    self._pinned.discard(job.step)
                    self._lock.notify_all()
                try:
                    self._retain()
                except Exception as e:  # noqa: BLE001
                    self._record(job.handle, CheckpointError(f"retention after step {job.step}: {e}",
                                                             step=job.step, stage="retention"), cause=e)

    def _background(self, job: _Job) -> None:
        step, handle = job.step, job.handle
        if not self._cleaned:  # leftovers of a crashed predecessor hold space and are never read
            self._persistent.remove_partial()
            for partial in snap.scan(self.options.peer_dir)[1].values():
                snap.remove_dir(partial)
            with self._lock:  # memory-tier .tmp dirs of steps nobody is writing (a recycling save took its pick)
                for s, partial in snap.scan(self._memory_root)[1].items():
                    if s not in self._pinned:
                        snap.remove_dir(partial)
            self._cleaned = True
        job.extra["stage"] = "snapshot"
        if job.held is not None and not self._copy_held(job):
            return
        t0 = self._clock()
        _, views = snap.map_data(job.tmp, job.index, private=False)
        index = job.index.with_checksums(digest_many([_bytes_view(views[a.name]) for a in job.index.arrays],
                                                    self._pool()))
        del views
        snap.write_index(job.tmp, index)
        fault_point("snapshot.commit", step)
        with self._lock:
            final = snap.step_dir(self._memory_root, step)
            snap.replace_dir(job.tmp, final)
        handle.timings["ckpt/checksum_s"] = self._clock() - t0
        handle._advance("snapshotted")
        with self._lock:
            newer = any(j.step > step for j in list(self._queue)[1:])
        keep_every = self.options.keep_every
        if newer and not (keep_every and step % keep_every == 0):
            log.info("checkpoint step %d: a newer save is queued; skipping its peer copy and persistence", step)
            handle._advance("superseded")
            return
        if self.options.peer_dir is not None:
            job.extra["stage"] = "peer"
            t0 = self._clock()
            try:
                snap.copy_committed(final, self.options.peer_dir, step, fault=lambda: fault_point("peer.commit", step))
                handle.timings["ckpt/peer_s"] = self._clock() - t0
                handle._advance("backed_up")
            except Exception as e:  # noqa: BLE001 - a peer failure must not stop persistence
                self._record(handle, CheckpointError(f"checkpoint step {step}: peer copy failed: {e}", step=step,
                                                     stage="peer"), cause=e)
        job.extra["stage"] = "persist"
        t0 = self._clock()
        _, views = snap.open_arrays(final, private=False)
        self._persistent.save(index, views)
        handle.timings["ckpt/persist_s"] = self._clock() - t0
        handle.timings["ckpt/total_s"] = self._clock() - job.started
        handle._advance("persisted")

    def _retain(self) -> None:
        """keep_last in every tier; keep_every in the persistent tier (it is the long-term history; the memory and
        peer tiers are bounded by RAM). Steps still needed by background work are never removed."""
        opts = self.options
        with self._lock:
            committed, _ = snap.scan(self._memory_root)
            keep = steps_to_keep(committed, opts.keep_last)
            for s, path in committed.items():
                if s not in keep and s not in self._pinned:
                    snap.remove_dir(path)
        if opts.peer_dir is not None:
            committed, _ = snap.scan(opts.peer_dir)
            keep = steps_to_keep(committed, opts.keep_last)
            for s, path in committed.items():
                if s not in keep:
                    snap.remove_dir(path)
        committed, _ = self._persistent.scan()
        keep = steps_to_keep(committed, opts.keep_last, opts.keep_every)
        for s in committed:
            if s not in keep:
                self._persistent.delete(s)

    def _record(self, handle: SaveHandle | None, error: CheckpointError, cause: BaseException) -> None:
        error.__cause__ = cause
        log.error("%s", error)
        with self._lock:
            self._errors.append(error)
        if handle is not None:
            handle.errors.append(error)

    # ------------------------------------------------------------------------------------------- waiting, errors

    def wait(self) -> None:
        """Blocks until all background work is done; raises the errors not yet reported (one, or a summary)."""
        with self._lock:
            while self._queue or self._worker is not None:
                self._lock.wait()
        errors = self.poll_errors()
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise CheckpointError(f"{len(errors)} background checkpoint errors: " + " | ".join(map(str, errors)),
                                  errors=errors)

    def poll_errors(self) -> list[CheckpointError]:
        """Errors of background saves since the last call (each error is reported once, here or by wait())."""
        with self._lock:
            errors, self._errors = self._errors, []
        return errors

    # ------------------------------------------------------------------------------------------- reading

    def _committed(self) -> dict[Tier, dict[int, Path]]:
        return {"memory": snap.scan(self._memory_root)[0],
                "peer": snap.scan(self.options.peer_dir)[0] if self.options.peer_dir is not None else {},
                "persistent": self._persistent.scan()[0]}

    def _candidates(self, step: int | None) -> list[tuple[int, Tier, Path]]:
        """(step, tier, path), newest step first, fastest tier first within a step."""
        committed = self._committed()
        steps = sorted({s for tier in committed.values() for s in tier}, reverse=True)
        if step is not None:
            steps = [s for s in steps if s == step]
        return [(s, t, committed[t][s]) for s in steps for t in TIERS if s in committed[t]]

    def _load(self, step: int, tier: Tier, path: Path,
              verify: bool) -> tuple[snap.SnapshotIndex, dict[str, np.ndarray]]:
        pool = self._pool()
        if tier == "persistent":
            return self._persistent.load(step, verify=verify, pool=pool)
        index, arrays = snap.load(path, verify=verify, pool=pool)
        if tier == "memory":
            self._snapshot_writer().mark_exported(path)  # its bytes back these arrays: never overwrite in place
        return index, arrays

    def restore(self, step: int | None = None) -> Restored:
        """The newest valid checkpoint (or `step`), from memory, else peer, else persistent.

        A damaged copy (bad checksum, missing or truncated file, unreadable index) is skipped with a warning naming
        the problem, and the next copy or older step is tried. Raises CheckpointError if none is usable.
        """
        tried: list[str] = []
        for s, tier, path in self._candidates(step):
            try:
                index, arrays = self._load(s, tier, path, verify=self.options.verify_on_restore)
            except snap.SnapshotDamaged as e:
                log.warning("checkpoint step %d in the %s tier is damaged, skipping it: %s", s, tier, e)
                tried.extend(f"{tier} step {s}: {p}" for p in e.problems)
                continue
            return Restored(step=s, arrays=arrays, meta=index.meta, source=tier, path=path)
        what = "any step" if step is None else f"step {step}"
        detail = "; ".join(tried) if tried else f"no committed checkpoint in {self._tier_roots()}"
        raise CheckpointError(f"no valid checkpoint for {what}: {detail}", step=step, stage="restore")

    def latest_valid(self) -> CheckpointRef | None:
        """The newest checkpoint whose every checksum verifies, and the tier restore() would read it from; or None."""
        for s, tier, path in self._candidates(None):
            problems = self._check(s, tier, path)
            if not problems:
                return CheckpointRef(step=s, tier=tier, path=path)
            log.warning("checkpoint step %d in the %s tier is damaged: %s", s, tier, "; ".join(problems))
        return None

    def _check(self, step: int, tier: Tier, path: Path) -> list[str]:
        # Read-only shared mappings, dropped on return: checking never pins a snapshot the way restore's views do.
        return self._persistent.check(step, self._pool()) if tier == "persistent" else snap.check(path, self._pool())

    def list(self) -> list[CheckpointInfo]:
        """Every step present in any tier (committed or partial), oldest first; no checksum reading."""
        states = {"memory": "snapshotted", "peer": "backed_up", "persistent": "persisted"}
        found: dict[int, dict[str, TierState]] = {}
        scans = {"memory": snap.scan(self._memory_root),
                 "peer": snap.scan(self.options.peer_dir) if self.options.peer_dir else ({}, {}),
                 "persistent": self._persistent.scan()}
        for tier in TIERS:
            committed, partial = scans[tier]
            for s, path in partial.items():
                found.setdefault(s, {})[tier] = TierState("partial", snap.dir_bytes(path), path)
            for s, path in committed.items():  # a committed copy outranks a partial one of the same step
                found.setdefault(s, {})[tier] = TierState(states[tier], snap.dir_bytes(path), path)
        return [CheckpointInfo(step=s, tiers=found[s]) for s in sorted(found)]

    def verify(self, step: int) -> list[str]:
        """Problems of every committed copy of `step` (reads and checksums all of them); empty = all fine."""
        problems: list[str] = []
        copies = [(t, p) for s, t, p in self._candidates(step)]
        if not copies:
            return [f"step {step}: no committed copy in any tier ({self._tier_roots()})"]
        for tier, path in copies:
            problems.extend(f"{tier}: {p}" for p in self._check(step, tier, path))
        return problems

    def _tier_roots(self) -> str:
        return f"memory={self._memory_root}, peer={self.options.peer_dir}, persistent={self.options.persistent_dir}"

    # ------------------------------------------------------------------------------------------- closing

    def close(self) -> None:
        """Finishes background work and releases mappings and threads; errors stay available to poll_errors()."""
        if self._closed:
            return
        with self._lock:
            while self._queue or self._worker is not None:
                self._lock.wait()
        self._closed = True
        if self._writer is not None:
            self._writer.close()
        if self._checksum_pool is not None:
            self._checksum_pool.shutdown()

    def __enter__(self) -> "CheckpointEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------------------------------------- helpers


def _to_host(arrays: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """numpy views of the caller's arrays; device arrays are fetched with all transfers started first."""
    for x in arrays.values():
        if isinstance(x, jax.Array):
            x.copy_to_host_async()
    return {name: np.asarray(x) for name, x in arrays.items()}


def _bytes_view(arr: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
