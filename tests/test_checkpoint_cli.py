"""`angel-jax ckpt ls | verify` on a real training run's checkpoints, healthy and damaged."""

from __future__ import annotations

from pathlib import Path

import pytest

from angel_jax import cli
from angel_jax.checkpoint import CheckpointError
from angel_jax.config import load_config
from angel_jax.train.loop import train
from test_checkpoint_manager import largest_file


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


def test_verify_of_a_step_that_does_not_exist_says_so(run_dir, capsys):
    assert cli.main(["ckpt", "verify", str(run_dir), "999"]) == 1
    out = capsys.readouterr().out
    assert "no committed checkpoint of step 999 (committed steps: 2, 4)" in out and "DAMAGED" not in out


def _copy_run(run_dir: Path, into: Path) -> Path:
    """A copy of the run whose config names the copy and its own copy of the memory tier (the original stays
    intact)."""
    import shutil

    copy = into / "run"
    shutil.copytree(run_dir, copy)
    cfg = load_config(copy / "config.yaml")
    shutil.copytree(cfg.checkpoint.memory_dir, into / "mem")
    (copy / "config.yaml").write_text((copy / "config.yaml").read_text().replace(
        cfg.checkpoint.memory_dir, str(into / "mem")).replace(str(run_dir), str(copy)))
    (copy / ".lock").unlink(missing_ok=True)
    return copy


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax: see test_checkpoint_crash
def test_a_run_whose_every_checkpoint_is_damaged_is_not_silently_restarted(run_dir, tmp_path):
    copy = _copy_run(run_dir, tmp_path)
    for data in [*(tmp_path / "mem").glob("step_*/data.bin"),
                 *(largest_file(p) for p in (copy / "checkpoints").iterdir() if p.name.isdigit())]:
        raw = bytearray(data.read_bytes())
        for k in range(1, 40):  # bytes all over the file: whatever the encoding, the arrays cannot survive
            raw[k * len(raw) // 40] ^= 0xFF
        data.write_bytes(bytes(raw))
    metrics = (copy / "metrics.jsonl").read_text()
    cfg = load_config(copy / "config.yaml", ["train.steps=6"])
    with pytest.raises(CheckpointError, match="every checkpoint of the run in .* is damaged .* train.resume=false"):
        train(cfg)
    assert (copy / "metrics.jsonl").read_text() == metrics  # nothing of the run was overwritten
    result = train(load_config(copy / "config.yaml", ["train.steps=2", "train.resume=false"]))  # asked for: fine
    assert result.final_step == 2 and any(copy.parent.glob("run/checkpoints.replaced-*"))


def test_an_edited_index_is_a_damaged_copy_and_restore_falls_back(run_dir, tmp_path, capsys, caplog):
    import json

    copy = _copy_run(run_dir, tmp_path)
    index_file = tmp_path / "mem" / "step_4" / "index.json"
    index = json.loads(index_file.read_text())
    key = next(k for k, v in index["meta"]["data"].items() if isinstance(v, int) and not isinstance(v, bool))
    index["meta"]["data"][key] += 1  # the data position: a plausible value, only the checksum knows
    index_file.write_text(json.dumps(index))
    assert cli.main(["ckpt", "verify", str(copy), "4"]) == 1
    out = capsys.readouterr().out
    assert "step 4: DAMAGED" in out and "index checksum mismatch" in out and "persistent" not in out
    result = train(load_config(copy / "config.yaml", ["train.steps=5"]))
    assert result.final_step == 5
    assert "memory tier is damaged" in caplog.text  # skipped, and the persistent copy of step 4 restored
    assert '"tier": "persistent"' in [line for line in (copy / "events.jsonl").read_text().splitlines()
                                      if '"resumed"' in line][-1]


def test_a_final_checkpoint_that_never_reached_the_persistent_tier_is_persisted_by_the_rerun(run_dir, tmp_path):
    """As after a kill while the last step was being persisted: step 4 is in the memory tier, its persistent copy
    is an unfinished orbax directory. Running the finished job again persists step 4 and exits cleanly."""
    import shutil

    copy = _copy_run(run_dir, tmp_path)
    persistent = copy / "checkpoints"
    shutil.move(persistent / "4", persistent / "4.orbax-checkpoint-tmp-1")
    result = train(load_config(copy / "config.yaml"))
    assert result.final_step == 4 and (persistent / "4").is_dir()
    assert not list(persistent.glob("4.orbax-checkpoint-tmp*"))
    assert cli.main(["ckpt", "verify", str(copy), "4"]) == 0


def test_resuming_into_another_model_is_refused(run_dir, tmp_path):
    copy = _copy_run(run_dir, tmp_path)
    # 2 heads -> 1: every parameter keeps its shape, the model computes another function.
    written = (copy / "config.yaml").read_text()
    with pytest.raises(CheckpointError, match=r"step 4 holds another model .* model.n_heads=1 \(the checkpoint's: 2\)"):
        train(load_config(copy / "config.yaml", ["train.steps=6", "model.n_heads=1"]))
    assert (copy / "config.yaml").read_text() == written  # the refused run left the run's config as it was
    result = train(load_config(copy / "config.yaml", ["train.steps=5", "model.remat=true"]))  # same function
    assert result.final_step == 5


def test_missing_run_directory_is_a_clean_error(tmp_path, capsys):
    assert cli.main(["ckpt", "ls", str(tmp_path / "nope")]) == 1
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax: see test_checkpoint_crash
def test_a_full_persistent_disk_warns_and_training_finishes(tmp_path, write_tiny_config, caplog):
    """A real full file system under <run_dir>/checkpoints (a 400 KiB tmpfs; needs root, skipped otherwise): the
    orbax writes fail, the run trains to the end anyway, says so, and the memory tier still holds the snapshots."""
    import logging
    import subprocess

    from angel_jax.tee.events import read_events

    cfg_path = write_tiny_config(tmp_path, "full", train={"steps": 12},
                                 checkpoint={"every": 4, "keep": 2, "max_persist_failures": 0})  # 0: never stop
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
        assert "persist failed" in caplog.text
        assert cli.main(["ckpt", "ls", str(tmp_path / "full")]) == 0
        assert cli.main(["ckpt", "verify", str(tmp_path / "full"), "12"]) == 0  # the memory tier's copy
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _digests(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_step_symlinked_to_another_runs_is_not_loaded_and_verify_says_so(run_dir, tmp_path, capsys, caplog):
    """Step 4 of a copy of the run replaced by a symlink to the original run's step 4 (its memory-tier copy gone):
    `ckpt verify` names the link and fails, `ckpt ls` marks it, and `train` resumes the copy's own step 2, never
    the other run's state, leaving the other run's files as they were."""
    import shutil

    copy = _copy_run(run_dir, tmp_path)
    shutil.rmtree(copy / "checkpoints" / "4")
    (copy / "checkpoints" / "4").symlink_to(run_dir / "checkpoints" / "4")
    shutil.rmtree(tmp_path / "mem" / "step_4")
    theirs = _digests(run_dir / "checkpoints" / "4")
    link = f"the symlink {copy / 'checkpoints' / '4'} -> {run_dir / 'checkpoints' / '4'}"
    assert cli.main(["ckpt", "verify", str(copy)]) == 1
    out = capsys.readouterr().out
    assert "step 2: ok" in out and "step 4: NOT LOADED" in out and link in out and "mode 777" not in out
    assert cli.main(["ckpt", "ls", str(copy)]) == 0
    out = capsys.readouterr().out
    assert "NOT LOADED" in next(line for line in out.splitlines() if line.split()[:1] == ["4"]) and link in out
    result = train(load_config(copy / "config.yaml", ["train.steps=5"]))
    assert result.final_step == 5 and link in caplog.text and "mode 777" not in caplog.text
    assert '"step": 2' in [line for line in (copy / "events.jsonl").read_text().splitlines() if '"resumed"' in line][-1]
    assert _digests(run_dir / "checkpoints" / "4") == theirs


def test_a_checkpoints_directory_symlinked_to_another_runs_is_refused_naming_the_link(run_dir, tmp_path, capsys):
    """The copy's whole checkpoints/ a symlink to the original run's (and its memory tier empty): `ckpt verify`
    fails naming the link, and `train` refuses in one line naming it instead of resuming (or overwriting) the
    other run's checkpoints."""
    import shutil

    copy = _copy_run(run_dir, tmp_path)
    shutil.rmtree(copy / "checkpoints")
    (copy / "checkpoints").symlink_to(run_dir / "checkpoints")
    for step in (tmp_path / "mem").glob("step_*"):
        shutil.rmtree(step)
    theirs = _digests(run_dir / "checkpoints")
    link = f"the symlink {copy / 'checkpoints'} -> {run_dir / 'checkpoints'}"
    assert cli.main(["ckpt", "verify", str(copy)]) == 1
    out = capsys.readouterr().out
    # Every step the original persisted (step 4, and step 2 unless its save was skipped on a busy machine).
    persisted = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert 4 in persisted and all(f"step {s}: NOT LOADED" in out for s in persisted), (persisted, out)
    assert link in out and "mode 777" not in out
    with pytest.raises(CheckpointError, match="may not be loaded") as refused:
        train(load_config(copy / "config.yaml", ["train.steps=6"]))
    assert link in str(refused.value) and "train.resume=false" in str(refused.value)
    assert "\n" not in str(refused.value)
    assert _digests(run_dir / "checkpoints") == theirs
