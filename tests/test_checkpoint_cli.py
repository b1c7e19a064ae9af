"""`angel-jax ckpt ls | verify` on a real training run's checkpoints, healthy and damaged."""

from __future__ import annotations

from pathlib import Path

import pytest

from angel_jax import cli
from angel_jax.config import load_config
from angel_jax.train.loop import train


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, write_tiny_config) -> Path:
    directory = tmp_path_factory.mktemp("ckpt-cli")
    cfg_path = write_tiny_config(directory, "run", train={"steps": 4}, checkpoint={"every": 2, "keep": 2})
    train(load_config(cfg_path))
    return directory / "run"


def test_ls_lists_every_step_per_tier(run_dir, capsys):
    assert cli.main(["ckpt", "ls", str(run_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {int(line.split()[0]): line for line in lines[1:] if line.split()[0].isdigit()}
    assert set(rows) == {2, 4}
    assert "snapshotted" in rows[4] and "persisted" in rows[4]
    assert lines[-1].startswith("tiers: memory=") and str(run_dir / "checkpoints") in lines[-1]


def test_verify_passes_on_a_healthy_run(run_dir, capsys):
    assert cli.main(["ckpt", "verify", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "step 4: ok" in out and "DAMAGED" not in out


def test_verify_names_a_damaged_copy_and_fails(run_dir, capsys, tmp_path):
    import shutil

    damaged = tmp_path / "run"
    shutil.copytree(run_dir, damaged)
    cfg = load_config(damaged / "config.yaml")
    # Point the copy at its own (copied) memory tier so the original stays intact.
    shutil.copytree(cfg.checkpoint.memory_dir, tmp_path / "mem")
    (damaged / "config.yaml").write_text((damaged / "config.yaml").read_text().replace(
        cfg.checkpoint.memory_dir, str(tmp_path / "mem")))
    data = tmp_path / "mem" / "step_4" / "data.bin"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 3] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert cli.main(["ckpt", "verify", str(damaged), "4"]) == 1
    out = capsys.readouterr().out
    assert "step 4: DAMAGED" in out and "memory:" in out and "checksum mismatch" in out
    assert cli.main(["ckpt", "verify", str(damaged), "2"]) == 0


def test_missing_run_directory_is_a_clean_error(tmp_path, capsys):
    assert cli.main(["ckpt", "ls", str(tmp_path / "nope")]) == 1
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax: see test_checkpoint_crash
def test_a_full_persistent_disk_warns_and_training_finishes(tmp_path, write_tiny_config, caplog):
    """A real full file system under <run_dir>/checkpoints (a 400 KiB tmpfs; needs root, skipped otherwise): the
    orbax writes fail, the run trains to the end anyway, says so, and the memory tier still holds the snapshots."""
    import logging
    import subprocess

    from angel_jax.resilience.events import read_events

    cfg_path = write_tiny_config(tmp_path, "full", train={"steps": 12}, checkpoint={"every": 4, "keep": 2})
    mount = tmp_path / "full" / "checkpoints"
    mount.mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(mount)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    caplog.set_level(logging.WARNING)
    try:
        result = train(load_config(cfg_path))
        assert result.final_step == 12
        failures = [e for e in read_events(tmp_path / "full" / "events.jsonl") if e["kind"] == "checkpoint_failed"]
        assert failures and all("No space left" in e["message"] for e in failures)
        assert "checkpoint save failed, training goes on" in caplog.text
        assert cli.main(["ckpt", "ls", str(tmp_path / "full")]) == 0
        assert cli.main(["ckpt", "verify", str(tmp_path / "full"), "12"]) == 0  # the memory tier's copy
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
