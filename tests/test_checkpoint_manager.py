"""CheckpointManager against real files and real orbax: round trips, consistency, damage, partial saves, retention,
fallbacks. Every restore is compared bitwise with an independent copy taken before the save."""

from __future__ import annotations

import dataclasses
import os
import logging
import re
import shutil
import subprocess
import time
import threading
import xxhash
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

from angel_jax.checkpoint import CheckpointManager, CheckpointError, CheckpointOptions, StateSnapshot
from angel_jax.checkpoint import persist
from angel_jax.checkpoint.persist import OrbaxTier
from angel_jax.checkpoint.snapshot import read_index, write_index
from angel_jax.checkpoint.state import is_lazy


def make_state(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "stage0/params/w": rng.standard_normal((33, 17), dtype=np.float32),
        "stage0/params/w_bf16": rng.standard_normal(1000).astype(ml_dtypes.bfloat16),
        "opt/count": rng.integers(-2**31, 2**31 - 1, size=(5, 3), dtype=np.int32),
        "rng/key": rng.integers(0, 2**32 - 1, size=2, dtype=np.uint32),
        "scalar.loss_scale": np.array(rng.standard_normal(), dtype=np.float64),  # 0-d
        "empty": np.zeros((0, 4), np.float32),
        "mask": rng.random(9) > 0.5,
        "page_u8": rng.integers(0, 255, size=70000, dtype=np.uint8),  # spans pages of data.bin
    }


def copy_of(state: dict) -> dict[str, np.ndarray]:
    return {k: np.array(v, copy=True) for k, v in state.items()}


def assert_bitwise(restored: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert set(restored) == set(expected)
    for name, want in expected.items():
        got = restored[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert got.tobytes() == want.tobytes(), name


def options(tmp_path: Path, **kw) -> CheckpointOptions:
    kw.setdefault("persistent_dir", tmp_path / "persistent")
    kw.setdefault("memory_dir", tmp_path / "memory")
    return CheckpointOptions(**kw)


def largest_file(root: Path) -> Path:
    return max((p for p in root.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0xFF
    path.write_bytes(bytes(data))


# ----------------------------------------------------------------------------------------------- round trips


def test_round_trip_from_each_tier(tmp_path: Path) -> None:
    state, meta = make_state(1), {"data": {"shard": 3, "offset": 12345}, "lr": 3e-4, "tags": ["a", "b"]}
    with CheckpointManager(options(tmp_path, peer_dir=tmp_path / "peer")) as engine:
        handle = engine.save(10, state, meta)
        assert handle.stall_s > 0
        engine.wait()
        assert handle.state == "persisted" and not handle.errors
        for tier, wipe in (("memory", None), ("peer", tmp_path / "memory"), ("persistent", tmp_path / "peer")):
            if wipe is not None:
                shutil.rmtree(wipe)
            restored = engine.restore()
            assert (restored.step, restored.source) == (10, tier)
            assert_bitwise(restored.arrays, state)
            assert restored.meta == meta


def test_plain_orbax_reads_the_persistent_checkpoint(tmp_path: Path) -> None:
    """The module docstring's recipe: nothing from angel_jax is needed to read a persisted step."""
    state = make_state(2)
    with CheckpointManager(options(tmp_path)) as engine:
        engine.save(4, state, {"epoch": 1})
        engine.wait()
    mngr = ocp.CheckpointManager(tmp_path / "persistent")
    assert mngr.latest_step() == 4
    ckpt = mngr.restore(4, args=ocp.args.Composite(state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()))
    mngr.close()
    assert ckpt.meta["meta"] == {"epoch": 1}
    digests = {a["name"]: a["xxh3_64"] for a in ckpt.meta["arrays"]}
    for name, want in state.items():
        if want.size == 0:  # orbax refuses zero-size arrays: described in meta only
            assert name not in ckpt.state and name in digests
            continue
        got = np.asarray(ckpt.state[name])
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
        assert xxhash.xxh3_64_intdigest(got.tobytes()) == digests[name]


# ----------------------------------------------------------------------------------------------- consistency


def test_snapshot_is_a_copy_numpy_arrays_mutated_in_place(tmp_path: Path) -> None:
    state = make_state(3)
    expected = copy_of(state)
    with CheckpointManager(options(tmp_path)) as engine:
        engine.save(1, state, {})
        for arr in state.values():  # the trainer's next step overwrites its buffers at once
            if arr.size:
                arr.reshape(-1)[...] = np.zeros((), arr.dtype) if arr.dtype == bool else arr.reshape(-1)[::-1]
        engine.wait()
        assert_bitwise(engine.restore().arrays, expected)
        shutil.rmtree(tmp_path / "memory")  # the persisted copy was made from the snapshot, not the live arrays
        restored = engine.restore()
        assert restored.source == "persistent"
        assert_bitwise(restored.arrays, expected)


def test_snapshot_is_a_copy_jax_arrays_donated(tmp_path: Path) -> None:
    state = {"w": jnp.arange(4096, dtype=jnp.float32), "b": jnp.ones((8, 8), jnp.bfloat16)}
    expected = {k: np.array(v) for k, v in state.items()}
    step_fn = jax.jit(lambda s: jax.tree.map(lambda x: x * 3 + 1, s), donate_argnums=0)
    with CheckpointManager(options(tmp_path)) as engine:
        engine.save(1, state, {})
        state = step_fn(state)  # donates (deletes) the saved buffers where the backend supports it
        state = step_fn(state)
        engine.wait()
        assert_bitwise(engine.restore().arrays, expected)
        shutil.rmtree(tmp_path / "memory")
        assert_bitwise(engine.restore().arrays, expected)
    assert not np.array_equal(np.asarray(state["w"]), expected["w"])


# ----------------------------------------------------------------------------------------------- damage


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
# Reads still in flight when orbax gives up on a damaged file finish quietly, without a traceback each on stderr
# (pytest turns what reaches the interpreter's unraisable hook into this warning).
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_damaged_persisted_array_falls_back_to_older_step(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                          monkeypatch: pytest.MonkeyPatch, streamed: bool) -> None:
    if streamed:  # a state over the streaming threshold: still checked whole before anything is handed over
        monkeypatch.setattr(OrbaxTier, "stream_above", 0)
        monkeypatch.setattr(persist, "CHUNK_BYTES", 4096)
    s1, s2 = make_state(11), make_state(12)
    with CheckpointManager(options(tmp_path)) as engine:
        engine.save(1, s1, {"n": 1})
        engine.wait()  # back to back, step 1's persistence would be skipped as superseded by step 2
        engine.save(2, s2, {"n": 2})
        engine.wait()
        for data in (tmp_path / "persistent" / "2" / "state").rglob("d/*"):  # the data files orbax wrote
            flip_byte(data)
        shutil.rmtree(tmp_path / "memory")
        caplog.set_level(logging.WARNING)
        restored = engine.restore()
        assert (restored.step, restored.source, restored.meta) == (1, "persistent", {"n": 1})
        assert_bitwise({k: np.asarray(v) for k, v in restored.arrays.items()}, s1)
        warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
        assert "step 2" in warning and "persistent" in warning and "damaged" in warning
        assert engine.verify(2) and engine.verify(1) == []
        assert engine.latest_valid().step == 1
    time.sleep(0.5)  # (the reads in flight finish)


def test_a_state_over_the_streaming_threshold_is_restored_group_by_group(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A persistent checkpoint larger than half the RAM available is handed over as lazy arrays, read with orbax's
    partial restore a group of about CHUNK_BYTES at a time: once to verify every checksum, once as consumed."""
    rng = np.random.default_rng(21)
    state = {**make_state(21), **{f"pages/{i}": rng.standard_normal(1000, dtype=np.float32) for i in range(6)}}
    with CheckpointManager(options(tmp_path)) as engine:
        engine.save(4, state, {"k": 4})
        engine.wait()
    shutil.rmtree(tmp_path / "memory")
    monkeypatch.setattr(OrbaxTier, "stream_above", 0)
    monkeypatch.setattr(persist, "CHUNK_BYTES", 8192)
    groups: list[int] = []
    real = OrbaxTier._restore_some

    def counted(self, path, group):
        groups.append(sum(a.nbytes for a in group))
        return real(self, path, group)

    monkeypatch.setattr(OrbaxTier, "_restore_some", counted)
    with CheckpointManager(options(tmp_path)) as engine:
        restored = engine.restore()
    assert (restored.step, restored.source) == (4, "persistent")
    assert {k for k, v in restored.arrays.items() if is_lazy(v)} == {k for k, v in state.items() if v.nbytes}
    verified = len(groups)
    assert verified >= 4 and all(b <= 8192 or b == 70000 for b in groups)  # one array may exceed a group alone
    assert_bitwise({k: np.asarray(v) for k, v in restored.arrays.items()}, state)
    assert len(groups) == 2 * verified  # in index order: each group read once more


def test_damaged_memory_snapshot_uses_same_step_from_persistent(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    s1, s2 = make_state(21), make_state(22)
    with CheckpointManager(options(tmp_path)) as engine:
        engine.save(1, s1, {})
        engine.save(2, s2, {})
        engine.wait()
        entry = next(a for a in read_index(tmp_path / "memory" / "step_2").arrays if a.name == "opt/count")
        flip_byte(tmp_path / "memory" / "step_2" / "data.bin", entry.offset + 5)
        caplog.set_level(logging.WARNING)
        restored = engine.restore()
        # The newest step wins; only its damaged copy is skipped.
        assert (restored.step, restored.source) == (2, "persistent")
        assert_bitwise(restored.arrays, s2)
        assert "'opt/count' checksum mismatch" in caplog.text
        problems = engine.verify(2)
        assert len(problems) == 1 and problems[0].startswith("memory:") and "opt/count" in problems[0]


def test_a_partial_restore_reads_and_verifies_only_the_selected_arrays(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """restore(select=...) from each tier: the selected arrays bit for bit and nothing else; damage outside the
    selection does not disqualify a copy (it is never read), damage inside it does."""
    state = make_state(41)
    params = lambda name: name.startswith("stage0/params/")  # noqa: E731
    wanted = {k: v for k, v in state.items() if params(k)}
    with CheckpointManager(options(tmp_path)) as engine:
        engine.save(2, state, {"k": 2})
        engine.wait()
        index = read_index(tmp_path / "memory" / "step_2")
        offset = {a.name: a.offset for a in index.arrays}
        flip_byte(tmp_path / "memory" / "step_2" / "data.bin", offset["opt/count"] + 5)
        restored = engine.restore(select=params)
        assert (restored.step, restored.source, restored.meta) == (2, "memory", {"k": 2})
        assert_bitwise(restored.arrays, wanted)
        assert engine.restore().source == "persistent"  # the whole state: the damaged copy is skipped
        flip_byte(tmp_path / "memory" / "step_2" / "data.bin", offset["stage0/params/w"] + 5)
        assert engine.restore(select=params).source == "persistent"
    shutil.rmtree(tmp_path / "memory")
    groups: list[list[str]] = []
    real = OrbaxTier._restore_some

    def recorded(self, path, group):
        groups.append([a.name for a in group])
        return real(self, path, group)

    monkeypatch.setattr(OrbaxTier, "_restore_some", recorded)
    with CheckpointManager(options(tmp_path)) as engine:
        restored = engine.restore(select=params)
    assert restored.source == "persistent"
    assert_bitwise(restored.arrays, wanted)
    assert sorted(n for g in groups for n in g) == sorted(wanted)  # orbax read nothing else


def test_memory_tier_deleted_restores_from_persistent(tmp_path: Path) -> None:
    state = make_state(5)
    with CheckpointManager(options(tmp_path)) as engine:
        engine.save(3, state, {"k": "v"})
        engine.wait()
    shutil.rmtree(tmp_path / "memory")
    with CheckpointManager(options(tmp_path)) as fresh:  # a new process after a node reboot
        restored = fresh.restore()
        assert (restored.step, restored.source, restored.meta) == (3, "persistent", {"k": "v"})
        assert_bitwise(restored.arrays, state)


def test_partial_checkpoints_are_never_used(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    s1 = make_state(31)
    mem, pers = tmp_path / "memory", tmp_path / "persistent"
    with CheckpointManager(options(tmp_path)) as engine:
        engine.save(1, s1, {})
        engine.wait()
        # Complete-looking copies of step 1 under uncommitted names / without the index (the commit marker).
        shutil.copytree(mem / "step_1", mem / "step_3.tmp")
        write_index(mem / "step_3.tmp", dataclasses.replace(read_index(mem / "step_1"), step=3))
        shutil.copytree(pers / "1", pers / "3.orbax-checkpoint-tmp-1712345")
        shutil.copytree(mem / "step_1", mem / "step_4")
        (mem / "step_4" / "index.json").unlink()
        shutil.copytree(mem / "step_1", mem / "step_5")
        write_index(mem / "step_5", dataclasses.replace(read_index(mem / "step_1"), step=5))
        with open(mem / "step_5" / "data.bin", "r+b") as f:  # a torn write
            f.truncate(100)
        caplog.set_level(logging.WARNING)
        restored = engine.restore()
        assert (restored.step, restored.source) == (1, "memory")
        assert_bitwise(restored.arrays, s1)
        assert "step_4/index.json: missing" in caplog.text and "truncated" in caplog.text
        states = {info.step: {t: s.state for t, s in info.tiers.items()} for info in engine.list()}
        assert states[3] == {"memory": "partial", "persistent": "partial"}
        assert engine.verify(3)[0].startswith("step 3: no committed copy")
        with pytest.raises(CheckpointError, match="no valid checkpoint for step 4"):
            engine.restore(4)


# ----------------------------------------------------------------------------------------------- retention, list


def test_retention_keep_last_and_keep_every_in_every_tier(tmp_path: Path) -> None:
    opts = options(tmp_path, peer_dir=tmp_path / "peer", keep_last=2, keep_every=3)
    with CheckpointManager(opts) as engine:
        for step in range(1, 8):
            engine.save(step, make_state(step), {"step": step})
            engine.wait()
        infos = engine.list()
        tiers = {t: {i.step for i in infos if t in i.tiers} for t in ("memory", "peer", "persistent")}
        assert tiers == {"memory": {6, 7}, "peer": {6, 7}, "persistent": {3, 6, 7}}
        by_step = {i.step: i for i in infos}
        assert {t: s.state for t, s in by_step[7].tiers.items()} == {
            "memory": "snapshotted", "peer": "backed_up", "persistent": "persisted"}
        assert all(s.nbytes > 70000 for s in by_step[7].tiers.values())
        assert engine.verify(3) == [] and engine.verify(7) == []
        restored = engine.restore(3)  # an old kept step, from the only tier that has it
        assert (restored.source, restored.meta) == ("persistent", {"step": 3})
        assert_bitwise(restored.arrays, make_state(3))


def test_snapshot_buffers_are_reused_but_never_under_restored_arrays(tmp_path: Path) -> None:
    mem = tmp_path / "memory"
    with CheckpointManager(options(tmp_path, keep_last=1)) as engine:
        engine.save(1, make_state(1), {})
        engine.wait()
        inode1 = (mem / "step_1" / "data.bin").stat().st_ino
        engine.save(2, make_state(2), {})
        engine.wait()
        assert not (mem / "step_1").exists()
        assert (mem / "step_2" / "data.bin").stat().st_ino == inode1  # the evicted snapshot's file, recycled
        restored = engine.restore()
        assert restored.source == "memory"
        engine.save(3, make_state(3), {})
        engine.wait()
        # The restored arrays are views of step 2's file: it must not have been overwritten in place.
        assert (mem / "step_3" / "data.bin").stat().st_ino != inode1
        assert_bitwise(restored.arrays, make_state(2))
        restored.arrays["opt/count"][...] = 0  # copy-on-write: the trainer may write to them
        engine.save(4, make_state(4), {})
        engine.wait()
        assert_bitwise(engine.restore().arrays, make_state(4))


def test_back_to_back_saves_finish_and_newest_is_persisted(tmp_path: Path) -> None:
    with CheckpointManager(options(tmp_path, keep_last=3)) as engine:
        handles = [engine.save(s, make_state(s), {}) for s in (1, 2, 3)]
        engine.wait()
        assert all(h.done and h.state in ("persisted", "superseded") for h in handles)
        assert handles[-1].state == "persisted"
        shutil.rmtree(tmp_path / "memory")
        restored = engine.restore()
        assert restored.step == 3 and restored.source == "persistent"
        assert_bitwise(restored.arrays, make_state(3))


def save_three_behind_a_slow_disk(engine: CheckpointManager) -> list:
    """Save steps 1, 2 and 3 on a slow disk made deterministic: step 1's orbax write waits until steps 2 and 3 are
    queued behind it. Returns the three handles, every save finished."""
    entered, release = threading.Event(), threading.Event()
    real_save = engine._persistent.save

    def slow_save(index, arrays):
        entered.set()
        release.wait(30)
        return real_save(index, arrays)

    engine._persistent.save = slow_save
    handles = [engine.save(1, make_state(1), {})]
    assert entered.wait(30)
    handles += [engine.save(s, make_state(s), {}) for s in (2, 3)]
    release.set()
    engine.wait()
    return handles


@pytest.mark.parametrize("keep_every, expected", [(None, ["persisted", "superseded", "persisted"]),
                                                   (2, ["persisted", "persisted", "persisted"])])
def test_queued_older_save_is_superseded_unless_kept_by_keep_every(tmp_path: Path, keep_every: int | None,
                                                                    expected: list[str]) -> None:
    with CheckpointManager(options(tmp_path, keep_every=keep_every)) as engine:
        handles = save_three_behind_a_slow_disk(engine)
        assert [h.state for h in handles] == expected
        persisted = {i.step for i in engine.list() if "persistent" in i.tiers}
        assert persisted == {s for s, state in zip((1, 2, 3), expected) if state == "persisted"}
        assert_bitwise(engine.restore(2).arrays, make_state(2))  # the memory tier has it either way


def test_on_state_hears_each_state_once_it_holds(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Every state after the blocking part, in order, reported once it holds: a snapshotted step is restorable
    from the memory tier when it is heard of. A listener that raises loses its report, never the save."""
    heard: list[tuple[int, str, bool]] = []

    def on_state(step: int, state: str) -> None:
        heard.append((step, state, (tmp_path / "memory" / f"step_{step}").is_dir()))
        if step == 3:
            raise OSError("the event log's disk is full")

    with CheckpointManager(options(tmp_path), on_state=on_state) as engine:
        handles = save_three_behind_a_slow_disk(engine)
        assert heard == [(1, "snapshotted", True), (1, "persisted", True), (2, "snapshotted", True),
                         (2, "superseded", True), (3, "snapshotted", True), (3, "persisted", True)]
        assert [h.state for h in handles] == ["persisted", "superseded", "persisted"]
    assert "checkpoint step 3: reporting its state 'persisted' failed: the event log's disk is full" in caplog.text


def test_same_step_saved_again_replaces_it_everywhere(tmp_path: Path) -> None:
    with CheckpointManager(options(tmp_path)) as engine:
        engine.save(5, make_state(1), {"v": 1})
        engine.wait()
        engine.save(5, make_state(2), {"v": 2})  # e.g. after a rollback the step is reached again
        engine.wait()
        assert_bitwise(engine.restore().arrays, make_state(2))
        shutil.rmtree(tmp_path / "memory")
        restored = engine.restore()
        assert restored.meta == {"v": 2} and restored.source == "persistent"
        assert_bitwise(restored.arrays, make_state(2))


# ----------------------------------------------------------------------------------------------- errors


def test_bad_input_raises_before_anything_is_written(tmp_path: Path) -> None:
    with CheckpointManager(options(tmp_path)) as engine:
        with pytest.raises(TypeError, match="not JSON serializable"):
            engine.save(1, make_state(1), {"when": object()})
        with pytest.raises(TypeError, match="raw bytes"):
            engine.save(1, {"names": np.array(["a", "b"], dtype=object)}, {})
        with pytest.raises(ValueError, match="step"):
            engine.save(-1, make_state(1), {})
    assert not (tmp_path / "memory").exists() and not (tmp_path / "persistent").exists()
    with CheckpointManager(options(tmp_path)) as engine:
        with pytest.raises(CheckpointError, match="no valid checkpoint"):
            engine.restore()
        assert engine.latest_valid() is None and engine.list() == []


def test_background_error_is_surfaced_once_and_training_continues(tmp_path: Path) -> None:
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")  # persistent_dir below a regular file: every orbax save fails
    with CheckpointManager(options(tmp_path, persistent_dir=blocker / "ckpt")) as engine:
        handle = engine.save(1, make_state(1), {})
        assert handle.wait(timeout=60) == "failed"
        errors = engine.poll_errors()
        assert len(errors) == 1 and errors[0].step == 1 and errors[0].stage == "persist"
        assert engine.poll_errors() == []
        engine.wait()  # already reported: nothing to raise
        engine.save(2, make_state(2), {})  # the caller keeps training and saving
        with pytest.raises(CheckpointError, match="checkpoint step 2: persist failed"):
            engine.wait()
        restored = engine.restore()  # the memory tier still has the snapshots
        assert (restored.step, restored.source) == (2, "memory")


def test_unusable_memory_tier_falls_back_to_direct_persistence(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    state = make_state(6)
    caplog.set_level(logging.WARNING)
    with CheckpointManager(options(tmp_path, memory_dir=blocker / "shm")) as engine:
        handle = engine.save(1, state, {"m": 1})
        assert handle.state == "persisted"  # persisted before save() returned: nothing to copy from later
        assert "persisting directly" in caplog.text
        restored = engine.restore()
        assert (restored.step, restored.source) == (1, "persistent")
        assert_bitwise(restored.arrays, state)


def test_a_lazy_state_is_copied_one_array_at_a_time_and_persisted_through_a_disk_staging_file(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Pages of a state larger than RAM come as `LazyArray`s: each is read when it is copied, never all at once.
    Into the memory tier they go one by one; when the memory tier cannot take them, they are copied into a
    staging file on the persistent directory's disk and persisted from it (plain orbax could not take lazy
    arrays, and reading them all first would need the RAM that is missing), and the staging file goes."""
    import weakref

    from angel_jax.checkpoint.state import LazyArray

    state = make_state(6)
    alive, peak, reads = [0], [0], []

    def reader(name: str):
        def read() -> np.ndarray:
            reads.append(name)
            arr = np.array(state[name], copy=True)  # owns its memory: views of it keep it alive
            alive[0] += 1
            peak[0] = max(peak[0], alive[0])
            weakref.finalize(arr, lambda: alive.__setitem__(0, alive[0] - 1))
            return arr
        return read

    lazy = {k: LazyArray(v.shape, v.dtype, reader(k)) for k, v in state.items()}
    nonempty = sorted(k for k, v in state.items() if v.nbytes)  # an empty array has nothing to read
    with CheckpointManager(options(tmp_path)) as engine:  # the memory tier takes them
        engine.save(1, lazy, {"m": 1}).wait()
        assert sorted(reads) == nonempty and peak[0] == 1, (reads, peak)
        assert_bitwise(engine.restore(1).arrays, state)

    reads.clear()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    caplog.set_level(logging.WARNING)
    with CheckpointManager(options(tmp_path, memory_dir=blocker / "shm")) as engine:  # it cannot: persisted directly
        handle = engine.save(2, lazy, {"m": 2})
        assert handle.state == "persisted" and "persisting directly" in caplog.text
        assert sorted(reads) == nonempty and peak[0] == 1, (reads, peak)
        assert not [p.name for p in (tmp_path / "persistent").iterdir() if p.name.startswith(".staging")]
        restored = engine.restore(2)
        assert restored.source == "persistent"
        assert_bitwise(restored.arrays, state)


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    """A 2 MiB tmpfs (needs root / CAP_SYS_ADMIN, as in the dev container); skipped where mounting is not allowed."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_full_memory_tier_falls_back_with_a_warning(tmp_path: Path, small_tmpfs: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    big = {"w": np.random.default_rng(0).standard_normal(1 << 20, dtype=np.float32)}  # 4 MiB > 2 MiB tmpfs
    caplog.set_level(logging.WARNING)
    with CheckpointManager(options(tmp_path, memory_dir=small_tmpfs / "shm")) as engine:
        handle = engine.save(1, big, {})
        assert handle.state == "persisted"
        assert "No space left" in caplog.text and "persisting directly" in caplog.text
        assert not any(small_tmpfs.rglob("*.bin"))  # the failed reservation was given back
        assert_bitwise(engine.restore().arrays, big)


def test_a_snapshot_the_machine_has_no_ram_for_is_persisted_directly(tmp_path: Path, small_tmpfs: Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A tmpfs memory tier holds its files in RAM: a snapshot that would leave the machine with less than the
    margin available (told here through psutil: 1.5 GiB available) is refused before anything is written, with
    a warning naming the bytes, and the save persists directly: a state near the size of RAM never meets the OOM
    killer through its checkpoint. A tier on a disk file system is not limited by RAM."""
    from angel_jax.checkpoint import memtier

    real = memtier.psutil.virtual_memory()
    monkeypatch.setattr(memtier.psutil, "virtual_memory", lambda: real._replace(available=3 << 29))
    state = {"w": np.arange(1 << 16, dtype=np.float32)}
    caplog.set_level(logging.WARNING)
    with CheckpointManager(options(tmp_path, memory_dir=small_tmpfs / "shm")) as engine:
        handle = engine.save(1, state, {})
        assert handle.state == "persisted"
        assert re.search(r"the snapshot would take [\d,]+ B more of RAM, 1,610,612,736 B are available", caplog.text)
        assert "persisting directly" in caplog.text and not any(small_tmpfs.rglob("*.bin"))
        assert_bitwise(engine.restore().arrays, state)
    if not memtier.in_ram(tmp_path):
        with CheckpointManager(options(tmp_path / "disk")) as engine:
            assert engine.save(1, state, {}).wait() in ("snapshotted", "persisted")
            assert any((tmp_path / "disk" / "memory").rglob("data.bin"))


# ----------------------------------------------------------------------------------------------- held saves


def test_held_save_copies_in_the_background_and_releases(tmp_path: Path) -> None:
    """A held snapshot: save() takes references; the worker copies them and releases the snapshot, after which
    the caller may donate them. What was saved is the state at save(), although training went on with new
    arrays."""
    state = {"w": jnp.arange(1 << 16, dtype=jnp.float32), "b": jnp.ones((8, 8), jnp.bfloat16),
             "step": jnp.asarray(7, jnp.int32)}
    expected = {k: np.array(v) for k, v in state.items()}
    step_fn = jax.jit(lambda s: jax.tree.map(lambda x: x * 3 + 1, s))  # no donation while the save holds `state`
    donating = jax.jit(lambda s: jax.tree.map(lambda x: x * 3 + 1, s), donate_argnums=0)
    with CheckpointManager(options(tmp_path)) as engine:
        snapshot = StateSnapshot(state, held=True)
        handle = engine.save(1, snapshot, {"k": 1})
        new = step_fn(state)
        assert snapshot.wait_released(30)
        assert handle.timings["ckpt/copy_s"] >= 0 and handle.stall_s <= handle.timings["ckpt/copy_s"] + 1.0
        del state
        new = donating(new)  # the saved arrays are free now; later steps may donate as they like
        engine.wait()
        assert handle.state == "persisted"
        assert_bitwise(engine.restore().arrays, expected)
        shutil.rmtree(tmp_path / "memory")
        assert_bitwise(engine.restore().arrays, expected)
    assert not np.array_equal(np.asarray(new["w"]), expected["w"])


def test_held_save_into_a_full_memory_tier_persists_and_still_releases(tmp_path: Path, small_tmpfs: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    big = {"w": jnp.asarray(np.random.default_rng(1).standard_normal(1 << 20, dtype=np.float32))}  # 4 MiB
    expected = {"w": np.array(big["w"])}
    caplog.set_level(logging.WARNING)
    with CheckpointManager(options(tmp_path, memory_dir=small_tmpfs / "shm")) as engine:
        snapshot = StateSnapshot(big, held=True)
        handle = engine.save(1, snapshot, {})
        assert snapshot.wait_released(30)
        assert handle.wait(60) == "persisted"
        assert "persisting directly" in caplog.text
        assert_bitwise(engine.restore().arrays, expected)


def test_non_held_save_is_released_when_it_returns(tmp_path: Path) -> None:
    with CheckpointManager(options(tmp_path)) as engine:
        snapshot = StateSnapshot(make_state(5))
        engine.save(1, snapshot, {})
        assert snapshot.released
        with pytest.raises(RuntimeError, match="released"):
            snapshot.arrays  # noqa: B018 - a released snapshot keeps nothing alive


def test_a_snapshot_is_released_when_save_refuses_it(tmp_path: Path) -> None:
    with CheckpointManager(options(tmp_path)) as engine:
        snapshot = StateSnapshot({"o": np.array([object()])}, held=True)
        with pytest.raises(TypeError, match="raw bytes"):
            engine.save(1, snapshot, {})
        assert snapshot.released


def test_a_full_peer_tier_keeps_no_partial_copy(tmp_path: Path, small_tmpfs: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """The peer backup of a 4 MiB snapshot into a 2 MiB peer fails with a warning; the save still persists, and
    the peer holds no half-written step_<k>.tmp (it used to stay, holding the space the peer lacked)."""
    big = {"w": np.random.default_rng(2).standard_normal(1 << 20, dtype=np.float32)}
    caplog.set_level(logging.WARNING)
    with CheckpointManager(options(tmp_path, peer_dir=small_tmpfs / "peer")) as engine:
        handle = engine.save(1, big, {})
        assert handle.wait(60) == "persisted"
        assert_bitwise(engine.restore().arrays, big)
    assert "No space left" in caplog.text
    assert not list((small_tmpfs / "peer").iterdir())


# ----------------------------------------------------------------------------------------------- fault hook


def test_fault_hook_is_called_at_every_point_of_a_save_in_order(tmp_path: Path) -> None:
    """Faults enter as a callable; the env var (ANGEL_JAX_CKPT_KILL_AT) is only read at the edge (faults.from_env)."""
    from angel_jax.checkpoint import faults

    calls: list[tuple[str, int]] = []
    opts = options(tmp_path, peer_dir=tmp_path / "peer")
    with CheckpointManager(opts, fault=lambda point, step: calls.append((point, step))) as engine:
        engine.save(4, make_state(4), {})
        engine.wait()
    assert calls == [(p, 4) for p in faults.POINTS]
    assert faults.from_env({}) is faults.no_fault
    assert faults.from_env({faults.ENV: "peer.commit@3"}) is not faults.no_fault


def test_a_failing_peer_copy_is_reported_and_the_save_still_persists(tmp_path: Path) -> None:
    def fault(point: str, step: int) -> None:
        if point == "peer.commit":
            raise OSError("peer unreachable")

    with CheckpointManager(options(tmp_path, peer_dir=tmp_path / "peer"), fault=fault) as engine:
        handle = engine.save(1, make_state(1), {})
        assert handle.wait(60) == "persisted"
        errors = engine.poll_errors()
        assert [(e.stage, str(e)) for e in errors] == [("peer",
                                                        "checkpoint step 1: peer copy failed: peer unreachable")]
        assert "peer" not in engine.list()[0].tiers or engine.list()[0].tiers["peer"].state == "partial"


def test_a_renamed_checkpoint_is_damaged_not_the_step_its_name_says(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """The step is what the checksummed index says: step 30 renamed to 50, in every tier, is reported damaged by
    verify and skipped by restore, which falls back to step 20, the newest checkpoint that is what it says."""
    states = {s: make_state(s) for s in (20, 30)}
    with CheckpointManager(options(tmp_path, peer_dir=tmp_path / "peer")) as engine:
        for s, state in states.items():
            engine.save(s, copy_of(state), {"s": s})
        engine.wait()
    (tmp_path / "memory" / "step_30").rename(tmp_path / "memory" / "step_50")
    (tmp_path / "peer" / "step_30").rename(tmp_path / "peer" / "step_50")
    (tmp_path / "persistent" / "30").rename(tmp_path / "persistent" / "50")
    with CheckpointManager(options(tmp_path, peer_dir=tmp_path / "peer")) as engine:
        problems = engine.verify(50)
        assert len(problems) == 3 and all("holds step 30, but its name says step 50" in p for p in problems), problems
        assert engine.latest_valid().step == 20
        with caplog.at_level(logging.WARNING):
            restored = engine.restore()
        assert restored.step == 20 and restored.meta == {"s": 20}
        assert_bitwise(restored.arrays, states[20])
        assert "name says step 50" in caplog.text
        with pytest.raises(CheckpointError, match="name says step 50"):
            engine.restore(50)


@pytest.mark.skipif(os.getuid() != 0, reason="planting another user's checkpoint needs root (chown)")
def test_a_checkpoint_planted_by_another_user_or_in_a_shared_directory_is_never_loaded(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Step 30 owned by another uid (nobody) in every tier is not listed, verified or restored: restore takes step
    20, with one warning per refused copy naming the owner; a tier root others can write to is refused whole."""
    states = {s: make_state(s) for s in (20, 30)}
    with CheckpointManager(options(tmp_path, peer_dir=tmp_path / "peer")) as engine:
        for s, state in states.items():
            engine.save(s, copy_of(state), {"s": s})
        engine.wait()
    for planted in (tmp_path / "memory" / "step_30", tmp_path / "peer" / "step_30", tmp_path / "persistent" / "30"):
        os.chown(planted, 65534, 65534)
    with caplog.at_level(logging.WARNING), CheckpointManager(options(tmp_path, peer_dir=tmp_path / "peer")) as engine:
        restored = engine.restore()
        assert restored.step == 20 and restored.meta == {"s": 20}
        assert_bitwise(restored.arrays, states[20])
        assert all("belongs to uid 65534" in p for p in engine.verify(30)) and len(engine.verify(30)) == 3
        assert engine.latest_valid().step == 20
        refused = [r.getMessage() for r in caplog.records if "belongs to uid 65534" in r.getMessage()]
        assert len(refused) == 3, refused  # once each, however often the tiers are read
    (tmp_path / "persistent").chmod(0o777)
    (tmp_path / "memory").chmod(0o777)
    (tmp_path / "peer").chmod(0o777)
    with caplog.at_level(logging.WARNING), CheckpointManager(options(tmp_path, peer_dir=tmp_path / "peer")) as engine:
        with pytest.raises(CheckpointError, match="no valid checkpoint"):
            engine.restore()
    assert "is writable by other users (mode 777" in caplog.text


def test_a_symlinked_step_is_followed_inside_its_tier_and_refused_out_of_it(tmp_path: Path,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    """A persistent step directory that is a symlink: to a directory inside the tier it is loaded (its target's
    owner and mode are what count, not the link's own 777); to another tier's step it is refused, naming the link
    and its target, and `verify` reports it; a root symlinked out of `confined_to` is refused whole."""
    states = {s: make_state(s) for s in (20, 30)}
    for run in ("a", "b"):
        with CheckpointManager(options(tmp_path / run)) as engine:
            for s, state in states.items():
                engine.save(s, copy_of(state), {"s": s, "run": run})
                engine.wait()  # each persisted (a save queued behind a newer one would be skipped)
        shutil.rmtree(tmp_path / run / "memory")  # only the persistent copies are left
    b = tmp_path / "b" / "persistent"
    (b / "20").rename(b / "kept-20")
    (b / "20").symlink_to(b / "kept-20")  # inside the tier: followed
    shutil.rmtree(b / "30")
    (b / "30").symlink_to(tmp_path / "a" / "persistent" / "30")  # another run's step
    with caplog.at_level(logging.WARNING), CheckpointManager(options(tmp_path / "b")) as engine:
        restored = engine.restore()
        assert restored.step == 20 and restored.meta == {"s": 20, "run": "b"}
        assert engine.verify(20) == []
        problems = engine.verify(30)
        assert len(problems) == 1 and f"the symlink {b / '30'} -> {tmp_path / 'a' / 'persistent' / '30'}" in (
            problems[0]) and "not loaded" in problems[0]
        assert list(engine.refused()) == [("persistent", 30)]
    assert "mode 777" not in caplog.text and f"{b / '30'} -> " in caplog.text
    # The whole tier symlinked to another run's: refused when the tier must stay inside its run directory.
    shutil.rmtree(b)
    b.symlink_to(tmp_path / "a" / "persistent")
    with CheckpointManager(options(tmp_path / "b", confined_to=tmp_path / "b")) as engine:
        with pytest.raises(CheckpointError, match="no valid checkpoint"):
            engine.restore()
        assert all(f"the symlink {b} -> {tmp_path / 'a' / 'persistent'}" in p for p in engine.refusals())
    with CheckpointManager(options(tmp_path / "b")) as engine:  # unconfined (a bare manager): its root is its own
        assert engine.restore().meta == {"s": 30, "run": "a"}


def test_every_tier_a_run_creates_is_private(tmp_path: Path) -> None:
    """The memory, peer and persistent directories a save creates are 0700: no other user reads the state or
    plants a checkpoint in them (the persistent one was 0755)."""
    import stat

    with CheckpointManager(options(tmp_path, peer_dir=tmp_path / "peer")) as engine:
        engine.save(1, make_state(1), {})
        engine.wait()
    for tier in ("memory", "peer", "persistent"):
        assert stat.S_IMODE((tmp_path / tier).stat().st_mode) == 0o700, tier
