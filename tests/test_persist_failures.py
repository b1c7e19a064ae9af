"""A run whose checkpoints stop reaching the persistent tier stops instead of training on with every checkpoint in
RAM only: checkpoint.max_persist_failures failed persists in a row (a successful one resets the count) end it with
exit status 78 and one line naming the cause and the newest persisted step; the memory-tier snapshots are kept.

Persistence really fails in these tests (no mock of the engine): the persistent directory's path is a regular file,
or a tmpfs mounted there is filled up (root only; skipped where mounting is refused).
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from angel_jax import cli
from angel_jax.checkpoint import CheckpointManager, CheckpointOptions
from angel_jax.checkpoint.manager import PersistenceFailed, PersistStreak
from angel_jax.checkpoint.persist import _MutedThreadErrors
from angel_jax.config import ConfigError, Config, load_config
from angel_jax.errors import EXIT_CONFIG

ROOT = Path(__file__).resolve().parents[1]
CHILD_LIMIT_S = 180  # `timeout -s KILL` guard of the training child


# ----------------------------------------------------------------------------------------------- the policy


def test_the_streak_counts_failures_in_a_row_and_a_persist_resets_it():
    s = PersistStreak(limit=3)
    s = s.failed(2, "disk full").failed(4, "disk full")
    assert (s.failures, s.last_step, s.last_cause, s.exhausted) == (2, 4, "disk full", False)
    s = s.persisted()
    assert (s.failures, s.last_step, s.last_cause, s.exhausted) == (0, None, "", False)
    s = s.failed(8, "a").failed(10, "b")
    assert not s.exhausted
    s = s.failed(12, "c")
    assert (s.failures, s.last_step, s.last_cause, s.exhausted) == (3, 12, "c", True)
    assert s.failed(14, "d").exhausted  # past the limit it stays exhausted
    assert s.limit == 3  # the limit survives every outcome


def test_a_limit_of_zero_never_stops_and_one_stops_at_the_first_failure():
    never = PersistStreak(limit=0)
    for step in range(100):
        never = never.failed(step, "x")
    assert never.failures == 100 and not never.exhausted
    assert PersistStreak(limit=1).failed(1, "x").exhausted
    assert not PersistStreak(limit=1).exhausted


def test_the_streak_says_how_far_it_is():
    assert PersistStreak(limit=3).failed(1, "x").count_text() == "1 of 3 failed persists in a row"
    assert PersistStreak(limit=3).failed(1, "x").failed(2, "x").failed(3, "x").count_text() == \
        "3 of 3 failed persists in a row"
    assert PersistStreak().failed(1, "x").count_text() == "1 failed persist in a row"
    assert PersistStreak().failed(1, "x").failed(2, "x").count_text() == "2 failed persists in a row"
    assert PersistStreak(limit=1).failed(1, "x").count_text() == "1 of 1 failed persist in a row"


def test_the_streak_refuses_negative_counts():
    with pytest.raises(ValueError, match="limit and failures must be >= 0"):
        PersistStreak(limit=-1)


def test_the_run_stops_with_the_watchdogs_do_not_retry_status():
    assert PersistenceFailed("x").exit_code == EXIT_CONFIG == 78


# ----------------------------------------------------------------------------------------------- the config


def test_the_config_field_defaults_to_three_and_refuses_negative_values():
    assert Config().checkpoint.max_persist_failures == 3
    assert load_config(None, ["checkpoint.max_persist_failures=0"]).checkpoint.max_persist_failures == 0
    with pytest.raises(ConfigError, match=r"'checkpoint.max_persist_failures'.*must be >= 0"):
        load_config(None, ["checkpoint.max_persist_failures=-1"])
    with pytest.raises(ConfigError, match="max_persist_failures"):
        load_config(None, ["checkpoint.max_persist_failures=many"])


# ----------------------------------------------------------------------------------------------- the engine


def _state(step: int) -> dict[str, np.ndarray]:
    return {"w": np.full(1000, step, np.float32), "count": np.array(step, np.int32)}


def test_the_engine_counts_real_failures_and_stops_persisting_at_the_limit(tmp_path):
    """The persistent directory's path is a regular file (orbax cannot create it), then a directory again, then a
    file again: failures 1, 2, reset by a persist, 1, 2, 3; the next save is snapshotted and not persisted."""
    persistent = tmp_path / "persistent"
    persistent.write_text("a file where the persistent directory should be\n")
    options = CheckpointOptions(persistent_dir=persistent, memory_dir=tmp_path / "memory", keep_last=5)
    with CheckpointManager(options) as engine:
        engine.stop_persisting_after(3)
        states = [engine.save(s, _state(s), {"step": s}).wait() for s in (1, 2)]
        assert states == ["failed", "failed"] and engine.persist_streak.failures == 2
        persistent.unlink()  # fixed: the next persist succeeds and the count starts again
        assert engine.save(3, _state(3), {"step": 3}).wait() == "persisted"
        assert engine.persist_streak == PersistStreak(limit=3)
        persistent.rename(tmp_path / "moved-aside")
        persistent.write_text("broken again\n")
        states = [engine.save(s, _state(s), {"step": s}).wait() for s in (4, 5, 6)]
        assert states == ["failed"] * 3
        streak = engine.persist_streak
        assert (streak.failures, streak.last_step, streak.exhausted) == (3, 6, True)
        assert "File exists" in streak.last_cause or "Not a directory" in streak.last_cause
        seventh = engine.save(7, _state(7), {"step": 7})
        assert seventh.wait() == "failed" and seventh.errors == []  # not tried: the limit was reached
        errors = engine.poll_errors()
        assert [e.step for e in errors] == [1, 2, 4, 5, 6] and {e.stage for e in errors} == {"persist"}
        assert [re.search(r"\((\d) of 3 failed persists? in a row\)$", str(e)).group(1) for e in errors] == \
            ["1", "2", "1", "2", "3"]
        assert all("\n" not in str(e) for e in errors)
        memory = [i.step for i in engine.list() if "memory" in i.tiers and i.tiers["memory"].state == "snapshotted"]
        assert memory == [3, 4, 5, 6, 7]  # every snapshot is kept (keep_last=5), the unpersisted ones included
    assert sorted(p.name for p in (tmp_path / "moved-aside").iterdir()) == ["3"]


def test_orbax_thread_errors_are_muted_only_while_a_save_runs(caplog):
    """orbax logs an exception of its save threads with a traceback, and raises it from the save call as well:
    while one of our saves runs, only the engine's one line reports it."""
    muted = _MutedThreadErrors()
    absl = logging.getLogger("absl")
    caplog.set_level(logging.ERROR, logger="absl")
    thread_error = "[process=%d][thread=%s][operation_id=%s] _SignalingThread.run() raised an exception: %s"
    try:
        with muted.muted():
            absl.error(thread_error, 0, "np_type_handler", 1, "RESOURCE_EXHAUSTED")
            absl.error("something else that went wrong")
        absl.error(thread_error, 0, "np_type_handler", 2, "outside any save")
    finally:
        absl.removeFilter(muted)
    assert [r.getMessage() for r in caplog.records] == [
        "something else that went wrong", thread_error % (0, "np_type_handler", 2, "outside any save")]


# ----------------------------------------------------------------------------------------------- runs


def _train_child(cfg_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`angel-jax train` in a child process: its real exit status and stderr."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run(["timeout", "-s", "KILL", str(CHILD_LIMIT_S), sys.executable, "-m", "angel_jax.cli",
                           "train", str(cfg_path), *overrides], cwd=cfg_path.parent, env=env, capture_output=True,
                          text=True)


def _snapshots(memory_dir: Path) -> list[str]:
    return sorted((p.name for p in memory_dir.iterdir() if re.fullmatch(r"step_\d+", p.name)),
                  key=lambda name: int(name[5:]))


def _persist_failures(stderr: str) -> list[tuple[int, str]]:
    """(step, 'k of n') of every persist failure the child logged."""
    return [(int(m.group(1)), m.group(2)) for m in
            re.finditer(r"checkpoint step (\d+): persist failed: .* \((\d+ of \d+) failed persists? in a row\)$",
                        stderr, re.M)]


@pytest.mark.slow
def test_a_normal_run_names_its_newest_persisted_checkpoint(tmp_path, write_tiny_config, capsys):
    cfg_path = write_tiny_config(tmp_path, "run", train={"steps": 4}, checkpoint={"every": 2, "keep": 2})
    assert cli.main(["train", str(cfg_path)]) == 0
    done = [line for line in capsys.readouterr().out.splitlines() if line.startswith("done:")]
    assert len(done) == 1 and done[0].endswith("; newest persisted checkpoint: step 4"), done


@pytest.mark.slow
def test_a_persistent_path_that_is_a_file_stops_the_run_then_a_rerun_resumes_and_persists(
        tmp_path, write_tiny_config, capsys):
    """<run_dir>/checkpoints is a regular file: the saves of steps 2, 4, 6 fail (keep_every keeps each from being
    superseded), the run exits 78 with one line naming the cause and that nothing was persisted, and the memory
    tier keeps steps 6 and 8 (8 snapshotted, not persisted). Once the path is freed the same command resumes from
    the memory tier and persists step 8."""
    cfg_path = write_tiny_config(tmp_path, "run", train={"steps": 8},
                                 checkpoint={"every": 2, "keep": 2, "keep_every": 2, "max_persist_failures": 3})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").write_text("not a directory\n")

    child = _train_child(cfg_path)
    assert child.returncode == EXIT_CONFIG, child.stderr[-3000:]
    assert _persist_failures(child.stderr) == [(2, "1 of 3"), (4, "2 of 3"), (6, "3 of 3")], child.stderr[-3000:]
    stop = [line for line in child.stderr.splitlines() if line.startswith("error:")]
    assert len(stop) == 1, child.stderr[-3000:]
    assert "3 of 3 failed persists in a row (checkpoint.max_persist_failures=3), the last at step 6: " in stop[0]
    assert "File exists" in stop[0] and "No checkpoint persisted" in stop[0]
    assert f"the memory-tier snapshots of steps 6, 8 are kept in {run_dir}.memtier" in stop[0]
    assert "Traceback" not in child.stderr and "done:" not in child.stdout
    assert _snapshots(Path(f"{run_dir}.memtier")) == ["step_6", "step_8"]

    (run_dir / "checkpoints").unlink()
    assert cli.main(["train", str(cfg_path)]) == 0
    out = capsys.readouterr().out
    assert "done: step 8, no step trained by this run;" in out and "newest persisted checkpoint: step 8" in out
    assert (run_dir / "checkpoints" / "8").is_dir()


@pytest.mark.slow
def test_a_full_persistent_disk_stops_the_run_naming_the_newest_persisted_step(tmp_path, write_tiny_config, capsys):
    """A tmpfs at <run_dir>/checkpoints (root only): steps 2 and 4 persist, then the tmpfs is filled up; the resumed
    run's saves of steps 6, 8, 10 fail with one line each (no orbax traceback), and it stops naming step 4."""
    cfg_path = write_tiny_config(tmp_path, "run", train={"steps": 4},
                                 checkpoint={"every": 2, "keep": 2, "keep_every": 2, "max_persist_failures": 3})
    mount = tmp_path / "run" / "checkpoints"
    mount.mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        assert cli.main(["train", str(cfg_path)]) == 0
        assert "newest persisted checkpoint: step 4" in capsys.readouterr().out
        _fill(mount / "filler")

        child = _train_child(cfg_path, "train.steps=12")
        assert child.returncode == EXIT_CONFIG, child.stderr[-3000:]
        assert _persist_failures(child.stderr) == [(6, "1 of 3"), (8, "2 of 3"), (10, "3 of 3")], \
            child.stderr[-3000:]
        stop = [line for line in child.stderr.splitlines() if line.startswith("error:")]
        assert len(stop) == 1 and "No space left" in stop[0], child.stderr[-3000:]
        assert "the last at step 10: " in stop[0] and "Newest persisted checkpoint: step 4;" in stop[0]
        assert "Traceback" not in child.stderr and "_SignalingThread" not in child.stderr
        assert _snapshots(Path(f"{tmp_path / 'run'}.memtier")) == ["step_10", "step_12"]
        assert sorted(p.name for p in mount.iterdir()) == ["2", "4", "filler"]  # failed saves leave nothing
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(path: Path) -> None:
    """Writes `path` until its file system is full (unbuffered: nothing is left to write at close)."""
    with open(path, "wb", buffering=0) as f:
        try:
            while f.write(b"\0" * 4096):
                pass
        except OSError:
            pass
