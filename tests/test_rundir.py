"""Safety of the run directory and the memory tier: one run per run directory (a lock the kernel releases on any
exit), and a memory tier that deletes nothing it did not write."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from angel_jax.checkpoint import CheckpointError
from angel_jax.config import ConfigError
from angel_jax.train.tier_ownership import (OWNER_FILE, RUN_TOKEN_FILE, TIER_LOCK_FILE, claim_memory_tier,
                                           release_memory_tier)
from angel_jax.train.rundir import LOCK_FILE, RunDirectoryInUse, lock_run_dir

ROOT = Path(__file__).resolve().parent.parent


def test_a_second_lock_is_refused_naming_the_holder_until_released(tmp_path):
    run = tmp_path / "run"
    held = lock_run_dir(run)
    with pytest.raises(RunDirectoryInUse, match=rf"{run} is in use by another run \(pid {os.getpid()} on "):
        lock_run_dir(run)
    held.release()
    held.release()  # idempotent
    lock_run_dir(run).release()


def test_the_lock_dies_with_a_sigkilled_holder(tmp_path):
    run = tmp_path / "run"
    code = ("import sys, time; from angel_jax.train.rundir import lock_run_dir; lock_run_dir(sys.argv[1]); "
            "print('locked', flush=True); time.sleep(60)")
    # No `timeout` wrapper: the signal must reach the holder itself (it ends by itself after 60 s regardless).
    child = subprocess.Popen([sys.executable, "-c", code, str(run)], stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        assert child.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirectoryInUse, match="in use by another run"):
            lock_run_dir(run)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        deadline = time.monotonic() + 10
        while True:  # the kernel releases the lock as the process goes
            try:
                lock_run_dir(run).release()
                break
            except RunDirectoryInUse:
                assert time.monotonic() < deadline
                time.sleep(0.05)
    finally:
        child.kill()


def test_a_run_directory_that_is_a_file_is_a_config_error(tmp_path):
    (tmp_path / "file").write_text("mine")
    with pytest.raises(ConfigError, match=r"'train.run_dir' .*file exists and is not a directory"):
        lock_run_dir(tmp_path / "file")
    assert (tmp_path / "file").read_text() == "mine"


def test_train_refuses_a_locked_run_directory_and_touches_nothing(tmp_path, write_tiny_config):
    cfg = write_tiny_config(tmp_path, "busy", train={"steps": 2})
    run = tmp_path / "busy"
    held = lock_run_dir(run)
    (run / "config.yaml").write_text("the first run's\n")
    try:
        proc = subprocess.run(["timeout", "-s", "KILL", "120", sys.executable, "-m", "angel_jax.cli", "train",
                               str(cfg)], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    finally:
        held.release()
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"is in use by another run (pid {os.getpid()}" in proc.stderr and "Traceback" not in proc.stderr
    assert (run / "config.yaml").read_text() == "the first run's\n"
    assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE, "config.yaml"]


# --------------------------------------------------------------------------------------------- the memory tier


def test_a_memory_tier_with_files_not_ours_is_refused_and_nothing_is_deleted(tmp_path):
    run, mem = tmp_path / "run", tmp_path / "mem"
    run.mkdir()
    mem.mkdir()
    (mem / "notes.txt").write_text("a user's file")
    (mem / "step_3").mkdir()
    (mem / "step_3" / "data.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=rf"memory_dir {mem} holds notes.txt, which are not checkpoint "
                                              "snapshots; nothing was deleted"):
        claim_memory_tier(run, mem)
    assert (mem / "notes.txt").read_text() == "a user's file" and (mem / "step_3" / "data.bin").exists()
    # a directory named like a snapshot but holding something else is not ours either
    (mem / "notes.txt").unlink()
    (mem / "step_3" / "thesis.tex").write_text("mine")
    with pytest.raises(CheckpointError, match="holds step_3"):
        claim_memory_tier(run, mem)
    assert (mem / "step_3" / "thesis.tex").exists()


def test_the_run_directory_as_memory_tier_is_refused(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "10").mkdir(parents=True)
    (run / "config.yaml").write_text("cfg")
    with pytest.raises(CheckpointError, match="holds checkpoints, config.yaml"):
        claim_memory_tier(run, run)
    assert (run / "config.yaml").read_text() == "cfg" and (run / "checkpoints" / "10").is_dir()
    assert not (run / OWNER_FILE).exists() and not (run / RUN_TOKEN_FILE).exists()


def test_another_runs_snapshots_are_the_only_thing_removed(tmp_path):
    run, mem = tmp_path / "run", tmp_path / "mem"
    run.mkdir()
    for name in ("step_4", "step_8.tmp"):
        (mem / name).mkdir(parents=True)
        (mem / name / "data.bin").write_bytes(b"old")
        (mem / name / "index.json").write_text("{}")
    (mem / OWNER_FILE).write_text("another-run\n")
    assert claim_memory_tier(run, mem) is True
    assert sorted(p.name for p in mem.iterdir()) == sorted([OWNER_FILE, TIER_LOCK_FILE])  # (the lock: this run's)
    assert (mem / OWNER_FILE).read_text() == (run / RUN_TOKEN_FILE).read_text()
    release_memory_tier(mem)


@pytest.mark.parametrize("where", ["file", "proc"])
def test_a_memory_tier_that_cannot_be_a_directory_is_left_alone(tmp_path, where, caplog):
    run = tmp_path / "run"
    run.mkdir()
    mem = tmp_path / "a-file" if where == "file" else Path("/proc/angel-jax-cannot-exist/mem")
    if where == "file":
        mem.write_text("mine")
    assert claim_memory_tier(run, mem) is False
    assert "checkpoints are persisted directly" in caplog.text
    if where == "file":
        assert mem.read_text() == "mine"


def _as_nobody(code: str, *args: str) -> None:
    """Run Python code as another user (uid/gid 65534), as a second local user would."""
    if os.getuid() != 0:
        pytest.skip("needs root to act as a second user")
    # A system interpreter: the test's own may live under a directory the second user cannot enter.
    python = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.access(p, os.X_OK)), None)
    if python is None:
        pytest.skip("no system python3 for the second user")
    # user= / group= switch in the child's C code (no Python runs between fork and exec: safe beside JAX threads).
    subprocess.run([python, "-c", code, *args], check=True, timeout=60, cwd="/", user=65534, group=65534,
                   extra_groups=[])


@pytest.fixture
def shared_dir():
    """A fresh directory under /dev/shm that a second user can reach (the pytest tmp_path is private to root)."""
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path("/tmp")
    path = base / f"angel-jax-test-{os.getpid()}-{time.monotonic_ns()}"
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)


PLANT = """
import json, os, sys
root = sys.argv[1]
os.makedirs(root + "/step_999", exist_ok=True)
os.chmod(root, int(sys.argv[2], 8))
open(root + "/step_999/data.bin", "wb").write(bytes(4096))
json.dump({"forged": True}, open(root + "/step_999/index.json", "w"))
"""


@pytest.mark.parametrize("mode", ["0777", "0755"])
def test_a_memory_tier_made_by_another_user_is_refused(tmp_path, shared_dir, mode):
    """Another local user pre-creates the memory tier (world-writable, or merely theirs) with a forged step 999:
    the run refuses the tier instead of resuming it, and deletes nothing of it."""
    run = tmp_path / "run"
    run.mkdir()
    _as_nobody(PLANT, str(shared_dir), mode)
    with pytest.raises(CheckpointError, match=r"belongs to uid 65534, not to this user|writable by other users"):
        claim_memory_tier(run, shared_dir)
    assert (shared_dir / "step_999" / "data.bin").exists()


def test_a_world_writable_memory_tier_of_ours_is_refused_and_new_ones_are_private(tmp_path):
    run, mem = tmp_path / "run", tmp_path / "mem"
    run.mkdir()
    mem.mkdir()
    mem.chmod(0o777)
    with pytest.raises(CheckpointError, match=r"writable by other users \(mode 777\)"):
        claim_memory_tier(run, mem)
    mem.chmod(0o755)
    claim_memory_tier(run, mem)
    fresh = tmp_path / "fresh" / "mem"
    claim_memory_tier(run, fresh)
    assert fresh.stat().st_mode & 0o777 == 0o700
    assert (run / RUN_TOKEN_FILE).stat().st_mode & 0o777 == 0o600
    assert (fresh / OWNER_FILE).stat().st_mode & 0o777 == 0o600
