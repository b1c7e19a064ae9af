"""CheckpointManager: the small manager that chains the tiers (memory -> peer -> persistent) for saves and restores.

A save, in order:

    save()  [blocks]   copy every array into memory_dir/step_<k>.tmp/data.bin              state "copied"
    worker             XXH3-64 of the copy, index.json, rename to step_<k>/  (the commit) state "snapshotted"
    worker             copy to peer_dir/step_<k>/ (tmp + fsync + rename), or to the next    state "backed_up"
                       node's memory over the network (netpeer.py)
    worker             orbax save of the snapshot's bytes to persistent_dir/<k>/          state "persisted"
    worker             retention in every tier

The tiers (tiers.py: memtier.MemoryTier, peer.PeerTier or netpeer.NetworkPeerTier, persist.OrbaxTier) know how to store, list, load, check
and delete steps; this module decides the order, what runs in the background (worker.py) and what a failure
means. Restore, latest_valid and verify go through the tiers fastest first and fall back on damage.

A held state snapshot (state.StateSnapshot with held=True) moves the copy itself off the training thread too: the
engine only takes references to the arrays, and the worker copies them into the memory tier, then releases the
snapshot. The training stall is then the time to hand over references (microseconds), at the price of the arrays'
memory being kept until the copy is done. A snapshot that is not held (numpy arrays that the caller updates in
place, such as host pages) is copied before save() returns, and released then.

Why the checksum is not in the blocking part: hashing is cheap (XXH3-64, ~11 GB/s per core here) but not free, and
it is computed from the snapshot (never the live arrays). A snapshot only gets its committed name after its
checksums are written, so every committed checkpoint in every tier carries them. The price: a crash between save()
returning and the commit loses that snapshot, and restore falls back to the previous one.

Work for a step whose persistence has not started when a newer save arrives is skipped ("superseded", except steps
kept by keep_every): the memory tier has it, and persisting an older state behind a newer one only delays the newer.
Errors of background work are kept and surfaced once, by poll_errors() or wait(); training is never interrupted
by the engine. Each error is logged once, on one line naming its cause.
Faults (crash tests) enter as the `fault` callable (faults.py), never through the environment.

Persistence failures are also counted (PersistStreak: consecutive failed persists, reset by a successful one) so
that the caller can stop a run whose checkpoints never leave RAM. Once the streak reaches the limit set by
stop_persisting_after(), later saves are snapshotted into the memory tier but not persisted: the directory has
already refused that many in a row, and the caller is about to stop.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import numpy as np

from angel_jax.checkpoint import snapshot as snap
from angel_jax.checkpoint.faults import Fault, no_fault
from angel_jax.checkpoint.filetier import FileTier
from angel_jax.checkpoint.memtier import MemoryTier, MemoryTierFull
from angel_jax.checkpoint.options import CheckpointOptions
from angel_jax.checkpoint.peer import peer_tier
from angel_jax.checkpoint.persist import OrbaxTier
from angel_jax.checkpoint.records import CheckpointError, CheckpointInfo, CheckpointRef, Restored, TierState
from angel_jax.checkpoint.snapshot import remove_dir
from angel_jax.checkpoint.state import StateSnapshot, as_snapshot, is_lazy
from angel_jax.checkpoint.tiers import CheckpointTier, CopyTier
from angel_jax.checkpoint.trust import untrusted
from angel_jax.checkpoint.worker import Job, SaveHandle, SaveWorker
from angel_jax.checkpoint.writer import SnapshotWriter
from angel_jax.errors import EXIT_CONFIG

log = logging.getLogger(__name__)

__all__ = ["CheckpointManager", "PersistStreak", "PersistenceFailed", "SaveHandle"]


@dataclasses.dataclass(frozen=True)
class PersistStreak:
    """Consecutive failed persists (pure: each outcome gives a new value). `limit` 0 never stops."""

    limit: int = 0
    failures: int = 0
    """Persists that failed since the last one that succeeded."""
    last_step: int | None = None
    """The step of the newest failure (None when the streak is clean)."""
    last_cause: str = ""
    """The newest failure's cause, one line."""

    def __post_init__(self) -> None:
        if self.limit < 0 or self.failures < 0:
            raise ValueError(f"PersistStreak: limit and failures must be >= 0, got {self.limit}, {self.failures}")

    def persisted(self) -> "PersistStreak":
        return dataclasses.replace(self, failures=0, last_step=None, last_cause="")

    def failed(self, step: int, cause: str) -> "PersistStreak":
        return dataclasses.replace(self, failures=self.failures + 1, last_step=step, last_cause=cause)

    @property
    def exhausted(self) -> bool:
        """Whether the caller should stop: `limit` persists in a row failed."""
        return self.limit > 0 and self.failures >= self.limit

    def count_text(self) -> str:
        """E.g. '2 of 3 failed persists in a row' (without a limit: '2 failed persists in a row')."""
        of = f" of {self.limit}" if self.limit else ""
        return f"{self.failures}{of} failed persist{'s' if max(self.failures, self.limit) != 1 else ''} in a row"


class PersistenceFailed(CheckpointError):
    """The run stops: its checkpoints have not reached the persistent tier for checkpoint.max_persist_failures
    saves in a row. Exits EXIT_CONFIG (errors.py says why a restart would not help)."""

    exit_code = EXIT_CONFIG


def one_line(e: BaseException) -> str:
    """An exception's message on one line (tensorstore and orbax messages span several)."""
    return " ".join(str(e).split()) or type(e).__name__


class CheckpointManager:
    """Saves to memory first, persists in the background, restores from the fastest valid tier."""

    def __init__(self, options: CheckpointOptions, *, clock: Callable[[], float] = time.monotonic,
                 fault: Fault = no_fault, on_state: Callable[[int, str], None] | None = None):
        """`on_state(step, state)` hears every state a save reaches after its blocking part (snapshotted: committed
        in the memory tier, backed_up, persisted, superseded, failed), once that state holds (a commit's rename is
        done); an error it raises is logged, and the save goes on."""
        self.options = options
        self._clock = clock
        self._on_state = on_state
        self._memory = MemoryTier(options.resolved_memory_dir(), options.keep_last, fault=fault)
        peer = peer_tier(options, fault)
        persistent = OrbaxTier if options.persistent_format == "orbax" else FileTier
        self._persistent = persistent(options.persistent_dir, options.keep_last, options.keep_every, fault=fault)
        self._downstream: tuple[CopyTier, ...] = (*([peer] if peer else []), self._persistent)
        self._tiers: tuple[CheckpointTier, ...] = (self._memory, *self._downstream)  # restore order: fastest first
        self.peer = peer
        """The peer tier (a mounted directory, or the next node over the network), or None."""
        self._worker = SaveWorker(self._process)
        self._errors_lock = threading.Lock()
        self._errors: list[CheckpointError] = []
        self._streak = PersistStreak()  # replaced, never changed, under _errors_lock: the worker writes it
        self._checksum_pool: ThreadPoolExecutor | None = None
        self._cleaned = False
        self._closed = False
        self._untrusted_seen: set[str] = set()  # (each refusal is logged once)

    def _pool(self) -> ThreadPoolExecutor | None:
        """Threads that hash arrays (xxhash releases the GIL on large buffers); created on first use."""
        if self.options.io_threads > 1 and self._checksum_pool is None:
            self._checksum_pool = ThreadPoolExecutor(self.options.io_threads, thread_name_prefix="ckpt-hash")
        return self._checksum_pool

    # ------------------------------------------------------------------------------------------- saving

    def save(self, step: int, state: StateSnapshot | Mapping[str, np.ndarray | jax.Array],
             meta: dict[str, Any]) -> SaveHandle:
        """Snapshots `state` into the memory tier and returns; the rest happens in the background.

        `state` is a StateSnapshot or a plain mapping (a snapshot that is not held). Not held: the arrays are
        copied before this returns and may be modified, donated or deleted afterwards. Held: the copy into the
        memory tier happens in the background as well, and the snapshot is released when it is done (or failed).
        Either way the snapshot is released, also when this raises. Bad input (non-JSON meta, object dtypes, a
        negative step) raises here, before anything is written. If the memory tier is full or unusable, the state
        is persisted directly (blocking, or in the background when held) with a warning.
        """
        snapshot = as_snapshot(state)
        try:
            return self._save(step, snapshot, meta)
        except BaseException:
            snapshot.release()
            raise

    def _save(self, step: int, snapshot: StateSnapshot, meta: dict[str, Any]) -> SaveHandle:
        if self._closed:
            raise CheckpointError("engine is closed", step=step, stage="save")
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        started = self._clock()
        index = snap.plan_layout(step, snapshot.arrays, meta)
        job = Job(step, index, SaveHandle(step, self._report_state if self._on_state else None), started)
        self._memory.pin(step)  # the same step again while its previous save is in flight: let it finish
        if snapshot.held:
            for x in snapshot.arrays.values():  # start device-to-host transfers now; the worker waits for them
                if isinstance(x, jax.Array):
                    x.copy_to_host_async()
            job.held = snapshot
        else:
            try:
                in_memory = self._write_memory(job, snapshot.arrays, "persisting directly (blocking) instead")
            except BaseException:
                self._memory.unpin(step)
                raise
            finally:
                snapshot.release()
            if not in_memory:
                self._memory.unpin(step)
                job.handle.stall_s = job.handle.timings["ckpt/stall_s"] = self._clock() - started
                return job.handle
        job.handle.stall_s = job.handle.timings["ckpt/stall_s"] = self._clock() - started
        self._worker.submit(job)
        return job.handle

    def _report_state(self, step: int, state: str) -> None:
        try:
            self._on_state(step, state)
        except Exception as e:  # noqa: BLE001 - a listener's failure (an unwritable event log) is not the save's
            log.warning("checkpoint step %d: reporting its state %r failed: %s", step, state, one_line(e))

    def _write_memory(self, job: Job, arrays: Mapping[str, Any], fallback: str) -> bool:
        """Copies the arrays into the memory tier (job.tmp). Returns False when the tier could not take them and
        the state was persisted directly instead."""
        host = _to_host(arrays)
        try:
            job.tmp = self._memory.write(job.step, job.index, host)
        except MemoryTierFull as e:
            log.warning("checkpoint step %d: %s; %s", job.step, e, fallback)
            self._persist_directly(job.index, host, job.handle)
            return False
        return True

    def _copy_held(self, job: Job) -> bool:
        """The background half of a held save: copy the arrays into the memory tier, then release them."""
        t0 = self._clock()
        try:
            return self._write_memory(job, job.held.arrays, "persisting directly instead")
        finally:
            job.held.release()
            job.held = None
            job.handle.timings["ckpt/copy_s"] = self._clock() - t0

    def _persist_directly(self, index: snap.SnapshotIndex, host: Mapping[str, Any], handle: SaveHandle) -> None:
        t0 = self._clock()

        def write() -> None:
            if any(is_lazy(x) for x in host.values()):
                self._persist_staged(index, host)
            else:
                self._persistent.save(snap.checksummed(index, host, self._pool()), host)

        if not self._persist(index.step, handle, write, how=" (direct)"):
            handle._advance("failed")
            return
        handle.timings["ckpt/persist_s"] = self._clock() - t0
        handle._advance("persisted")
        self._retain(handle, index.step)

    def _persist_staged(self, index: snap.SnapshotIndex, host: Mapping[str, Any]) -> None:
        """Persist a lazy state (larger than RAM) that the memory tier could not take: copy it array by array into
        a snapshot file beside the persistent directory (on its disk, not in RAM), checksum that copy and persist
        it from read-only views of the file, then delete it. Memory holds one array at a time, plus what the page
        cache keeps of the file."""
        staging = Path(self.options.persistent_dir) / f".staging-{index.step}"
        writer = SnapshotWriter(staging)
        try:
            tmp = writer.prepare(index.step, index, [])
            writer.copy(tmp, index, host)
            _, views = snap.map_data(tmp, index, private=False)
            self._persistent.save(snap.checksummed(index, views, self._pool()), views)
            del views
        finally:
            writer.close()
            remove_dir(staging)

    # ------------------------------------------------------------------------------------------- background

    def _process(self, job: Job) -> None:
        """The worker's entry: one save through the tiers; every failure is recorded, none escapes."""
        try:
            self._background(job)
        except Exception as e:  # noqa: BLE001
            message = f"checkpoint step {job.step}: {job.stage} failed: {one_line(e)}"
            self._record(job.handle, CheckpointError(message, step=job.step, stage=job.stage), cause=e)
            job.handle._advance("failed")
        finally:
            if job.held is not None:  # also when the copy failed: the caller's arrays are free either way
                job.held.release()
                job.held = None
            self._memory.unpin(job.step)
            self._retain(job.handle, job.step)

    def _background(self, job: Job) -> None:
        step, handle = job.step, job.handle
        if not self._cleaned:  # leftovers of a crashed predecessor hold space and are never read
            for tier in reversed(self._tiers):
                tier.remove_partial()
            self._cleaned = True
        job.stage = "snapshot"
        if job.held is not None and not self._copy_held(job):
            return
        t0 = self._clock()
        committed = self._memory.commit(step, job.tmp, job.index, self._pool())
        handle.timings["ckpt/checksum_s"] = self._clock() - t0
        handle._advance("snapshotted")
        keep_every = self.options.keep_every
        if self._worker.newer_queued(step) and not (keep_every and step % keep_every == 0):
            log.info("checkpoint step %d: a newer save is queued; skipping its peer copy and persistence", step)
            handle._advance("superseded")
            return
        for tier in self._downstream:
            job.stage = tier.stage
            t0 = self._clock()
            if tier is self._persistent:
                if not self._persist(step, handle, lambda: self._persistent.copy_from(committed)):
                    handle._advance("failed")
                    return
            else:
                try:
                    tier.copy_from(committed)
                except Exception as e:  # noqa: BLE001 - a best-effort tier's failure must not stop the next tier
                    if not tier.best_effort:
                        raise
                    self._record(handle, CheckpointError(f"checkpoint step {step}: {tier.stage} copy failed: "
                                                         f"{one_line(e)}", step=step, stage=tier.stage), cause=e)
                    continue
            handle.timings[f"ckpt/{tier.stage}_s"] = self._clock() - t0
            if tier is self._downstream[-1]:
                handle.timings["ckpt/total_s"] = self._clock() - job.started
            handle._advance(tier.committed_state)

    def _persist(self, step: int, handle: SaveHandle, write: Callable[[], object], how: str = "") -> bool:
        """Runs one persist (`write`) and counts its outcome in the streak; a failure is recorded on one line
        naming its cause and the streak. False when it failed, or was not tried because the streak is exhausted."""
        if self.persist_streak.exhausted:
            log.info("checkpoint step %d: not persisted (%s; the caller stops); its memory-tier snapshot is kept",
                     step, self.persist_streak.count_text())
            return False
        try:
            write()
        except Exception as e:  # noqa: BLE001 - every failure is surfaced, never swallowed
            streak = self._update_streak(lambda s: s.failed(step, one_line(e)))
            self._record(handle, CheckpointError(f"checkpoint step {step}: persist failed{how}: {one_line(e)} "
                                                 f"({streak.count_text()})", step=step, stage="persist"), cause=e)
            return False
        self._update_streak(PersistStreak.persisted)
        return True

    def _update_streak(self, change: Callable[[PersistStreak], PersistStreak]) -> PersistStreak:
        with self._errors_lock:
            self._streak = change(self._streak)
            return self._streak

    @property
    def persist_streak(self) -> PersistStreak:
        """Failed persists in a row so far (an immutable value; the background worker replaces it)."""
        with self._errors_lock:
            return self._streak

    def stop_persisting_after(self, failures: int) -> None:
        """Stop persisting once `failures` persists in a row have failed (0 = never stop; the default). Later
        saves are still snapshotted into the memory tier; the caller reads `persist_streak` to stop itself."""
        self._update_streak(lambda s: dataclasses.replace(s, limit=failures))

    def _retain(self, handle: SaveHandle, step: int) -> None:
        """keep_last in every tier; keep_every in the persistent tier (it is the long-term history; the memory and
        peer tiers are bounded by RAM). Steps still needed by background work are never removed."""
        try:
            for tier in self._tiers:
                tier.retain()
        except Exception as e:  # noqa: BLE001
            self._record(handle, CheckpointError(f"retention after step {step}: {e}", step=step,
                                                 stage="retention"), cause=e)

    def _record(self, handle: SaveHandle | None, error: CheckpointError, cause: BaseException) -> None:
        error.__cause__ = cause
        log.error("%s", error)
        with self._errors_lock:
            self._errors.append(error)
        if handle is not None:
            handle.errors.append(error)

    # ------------------------------------------------------------------------------------------- waiting, errors

    def wait(self) -> None:
        """Blocks until all background work is done; raises the errors not yet reported (one, or a summary)."""
        self._worker.drain()
        errors = self.poll_errors()
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise CheckpointError(f"{len(errors)} background checkpoint errors: " + " | ".join(map(str, errors)),
                                  errors=errors)

    def poll_errors(self) -> list[CheckpointError]:
        """Errors of background saves since the last call (each error is reported once, here or by wait())."""
        with self._errors_lock:
            errors, self._errors = self._errors, []
        return errors

    # ------------------------------------------------------------------------------------------- reading

    def _candidates(self, step: int | None) -> list[tuple[int, CheckpointTier, Path]]:
        """(step, tier, path), newest step first, fastest tier first within a step; only what `trust` allows."""
        committed = {tier.name: self._trusted(tier) for tier in self._tiers}
        steps = sorted({s for found in committed.values() for s in found}, reverse=True)
        if step is not None:
            steps = [s for s in steps if s == step]
        return [(s, t, committed[t.name][s]) for s in steps for t in self._tiers if s in committed[t.name]]

    def _trusted(self, tier: CheckpointTier) -> dict[int, Path]:
        """The tier's committed steps that may be loaded; each one refused is named once in a warning."""
        committed, refused = self._screen(tier)
        for text in refused.values():
            self._warn_untrusted(text)
        return committed

    def _screen(self, tier: CheckpointTier) -> tuple[dict[int, Path], dict[int | None, str]]:
        """(the tier's committed steps that may be loaded, why each other one may not: step -> one line, None for
        the whole tier). A step's directory must stay inside its tier's root, the persistent tier's root inside
        `confined_to` (the run directory), symlinks followed (`trust.untrusted`)."""
        within = self.options.confined_to if tier is self._persistent else None
        reason = untrusted(tier.root, root=True, within=within)
        if reason:
            return {}, {None: f"the {tier.name} tier {tier.root} {reason}: none of its checkpoints is loaded"}
        committed, refused = {}, {}
        for s, path in tier.scan()[0].items():
            if reason := untrusted(path, within=tier.root):
                refused[s] = f"checkpoint step {s} in the {tier.name} tier ({path}) {reason}: not loaded"
            else:
                committed[s] = path
        return committed, refused

    def refused(self) -> dict[tuple[str, int], str]:
        """(tier name, step) -> why that committed copy is not loaded, one line (`_screen`; a tier refused whole
        refuses each of its steps), fastest tier first."""
        found = {}
        for tier in self._tiers:
            _, refused = self._screen(tier)
            steps = tier.scan()[0] if None in refused else refused
            found.update({(tier.name, s): refused.get(None) or refused[s] for s in sorted(steps)})
        return found

    def refusals(self, step: int | None = None) -> list[str]:
        """Why committed copies (of `step`, or of any step) are not loaded: one line each (once per tier refused
        whole)."""
        return list(dict.fromkeys(text for (_, s), text in self.refused().items() if step is None or s == step))

    def _warn_untrusted(self, text: str) -> None:
        if text not in self._untrusted_seen:
            self._untrusted_seen.add(text)
            log.warning("%s", text)

    def restore(self, step: int | None = None, *, select: snap.Select | None = None) -> Restored:
        """The newest valid checkpoint (or `step`), from memory, else peer, else persistent.

        A damaged copy (bad checksum, missing or truncated file, unreadable index) is skipped with a warning naming
        the problem, and the next copy or older step is tried. Raises CheckpointError if none is usable.
        `select` (array name -> bool) restores part of the state, e.g. the parameters without the optimizer state:
        only those arrays are read and verified, and a copy is valid when they are.
        """
        tried: list[str] = []
        for s, tier, path in self._candidates(step):
            try:
                index, arrays = tier.load(s, verify=self.options.verify_on_restore, pool=self._pool(),
                                          select=select)
            except snap.SnapshotDamaged as e:
                log.warning("checkpoint step %d in the %s tier is damaged, skipping it: %s", s, tier.name, e)
                tried.extend(f"{tier.name} step {s}: {p}" for p in e.problems)
                continue
            return Restored(step=s, arrays=arrays, meta=index.meta, source=tier.name, path=path)
        what = "any step" if step is None else f"step {step}"
        detail = "; ".join(tried) if tried else f"no committed checkpoint in {self.tier_roots()}"
        raise CheckpointError(f"no valid checkpoint for {what}: {detail}", step=step, stage="restore")

    def latest_valid(self) -> CheckpointRef | None:
        """The newest checkpoint whose every checksum verifies, and the tier restore() would read it from; or None."""
        for s, tier, path in self._candidates(None):
            problems = tier.check(s, self._pool())
            if not problems:
                return CheckpointRef(step=s, tier=tier.name, path=path)
            log.warning("checkpoint step %d in the %s tier is damaged: %s", s, tier.name, "; ".join(problems))
        return None

    def list(self) -> list[CheckpointInfo]:
        """Every step present in any tier (committed or partial), oldest first; no checksum reading."""
        found: dict[int, dict[str, TierState]] = {}
        for tier in self._tiers:
            committed, partial = tier.sizes()
            for s, (path, nbytes) in partial.items():
                found.setdefault(s, {})[tier.name] = TierState("partial", nbytes, path)
            for s, (path, nbytes) in committed.items():  # a committed copy outranks a partial one of the same step
                found.setdefault(s, {})[tier.name] = TierState(tier.committed_state, nbytes, path)
        return [CheckpointInfo(step=s, tiers=found[s]) for s in sorted(found)]

    def verify(self, step: int) -> list[str]:
        """Problems of every committed copy of `step` (reads and checksums all of them; a copy that may not be
        loaded is one, `refusals`); empty = all fine."""
        copies = [tier for _, tier, _ in self._candidates(step)]
        refused = self.refusals(step)  # a copy that may not be loaded is a problem, even beside good ones
        if not copies and not refused:
            return [f"step {step}: no committed copy in any tier ({self.tier_roots()})"]
        return refused + [f"{tier.name}: {p}" for tier in copies for p in tier.check(step, self._pool())]

    def tier_roots(self) -> str:
        """Where each tier keeps its checkpoints, on one line (for messages that say where nothing was found)."""
        peer = self.options.peer_dir if self.options.peer_network is None else self.peer
        return f"memory={self._memory.root}, peer={peer}, persistent={self.options.persistent_dir}"

    # ------------------------------------------------------------------------------------------- closing

    def close(self) -> None:
        """Finishes background work and releases mappings and threads; errors stay available to poll_errors()."""
        if self._closed:
            return
        self._worker.drain()
        self._closed = True
        self._memory.close()
        if self._checksum_pool is not None:
            self._checksum_pool.shutdown()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _to_host(arrays: Mapping[str, Any]) -> dict[str, Any]:
    """numpy views of the caller's arrays; device arrays are fetched with all transfers started first. Lazy arrays
    (`LazyArray`: pages of a state larger than RAM) stay lazy: each is read when it is copied."""
    for x in arrays.values():
        if isinstance(x, jax.Array):
            x.copy_to_host_async()
    return {name: x if is_lazy(x) else np.asarray(x) for name, x in arrays.items()}
