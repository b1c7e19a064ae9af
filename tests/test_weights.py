"""load_params: a run's parameters read from its checkpoints equal the engine's own parameters at that step, for
the in-memory engine (one array per leaf) and the paged engine (pages unpacked with the layout rebuilt from the
config); a directory without a (valid) checkpoint is a clear error naming it."""

from __future__ import annotations

import shutil
from dataclasses import replace

import jax
import numpy as np
import pytest
import yaml

from angel_jax.checkpoint import CheckpointError
from angel_jax.checkpoint.snapshot import read_index
from angel_jax.train import state_formats
from angel_jax.train.protocol import StateMismatch
from angel_jax.train.weights import load_params


def _assert_equal_trees(got, want) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert isinstance(a, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def in_memory_run(trained_tiny_run):
    return trained_tiny_run("in_memory")


@pytest.fixture(scope="module")
def paged_run(trained_tiny_run):
    return trained_tiny_run("paged")


@pytest.mark.slow
@pytest.mark.parametrize("run", ["in_memory_run", "paged_run"])
def test_loaded_params_equal_the_engines_params_at_that_step(run, request):
    run_dir, engine_params = request.getfixturevalue(run)
    newest = load_params(run_dir)
    assert newest.step == 4 and newest.cfg.model.d_model == 32
    assert newest.cfg.memory.mode == ("paged" if run == "paged_run" else "in_memory")
    _assert_equal_trees(newest.params, engine_params[4])
    older = load_params(run_dir, step=2)
    assert older.step == 2
    if 2 in engine_params:
        _assert_equal_trees(older.params, engine_params[2])
    assert not np.array_equal(older.params["head"]["unembed"]["kernel"], newest.params["head"]["unembed"]["kernel"])


@pytest.mark.slow
def test_the_persistent_tier_alone_gives_the_same_params(paged_run, tmp_path):
    run_dir, engine_params = paged_run
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)  # another path: its memory tier is not the original's
    cfg = yaml.safe_load((copy / "config.yaml").read_text())
    cfg["checkpoint"]["memory_dir"] = str(tmp_path / "empty-memtier")
    (copy / "config.yaml").write_text(yaml.safe_dump(cfg))
    _assert_equal_trees(load_params(copy).params, engine_params[4])


@pytest.mark.slow
def test_a_memory_tier_of_another_run_is_not_read(in_memory_run, paged_run, tmp_path, caplog):
    """checkpoint.memory_dir pointed at another run's memory tier (whose token is not this run's): its snapshots
    are skipped, the persistent tier gives this run's own parameters."""
    run_dir, engine_params = in_memory_run
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    cfg = yaml.safe_load((copy / "config.yaml").read_text())
    cfg["checkpoint"]["memory_dir"] = f"{paged_run[0]}.memtier"
    (copy / "config.yaml").write_text(yaml.safe_dump(cfg))
    _assert_equal_trees(load_params(copy).params, engine_params[4])
    assert "holds snapshots of another run" in caplog.text


def test_a_missing_directory_or_one_without_checkpoints_is_named(tmp_path, write_tiny_config):
    with pytest.raises(CheckpointError, match=f"run directory {tmp_path / 'nothing'} does not exist"):
        load_params(tmp_path / "nothing")
    (tmp_path / "bare").mkdir()
    with pytest.raises(CheckpointError, match="no config.yaml"):
        load_params(tmp_path / "bare")
    run_dir = tmp_path / "untrained"
    run_dir.mkdir()
    shutil.copy(write_tiny_config(tmp_path, "untrained"), run_dir / "config.yaml")
    with pytest.raises(CheckpointError, match=f"run directory {run_dir} has no checkpoint"):
        load_params(run_dir)


@pytest.mark.slow
def test_a_missing_step_and_damaged_checkpoints_are_clear_errors(in_memory_run, tmp_path):
    run_dir, _ = in_memory_run
    with pytest.raises(CheckpointError, match=r"has no checkpoint of step 3 \(its steps: 2, 4\)"):
        load_params(run_dir, step=3)
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    shutil.copytree(f"{run_dir}.memtier", tmp_path / "memtier")
    cfg = yaml.safe_load((copy / "config.yaml").read_text())
    cfg["checkpoint"]["memory_dir"] = str(tmp_path / "memtier")
    (copy / "config.yaml").write_text(yaml.safe_dump(cfg))
    # Step 4: a parameter array flipped in the memory tier, the persistent copy's arrays gone -> step 2 is read.
    snapshot = tmp_path / "memtier" / "step_4"
    entry = next(a for a in read_index(snapshot).arrays if a.name == "params/head/unembed/kernel")
    data = bytearray((snapshot / "data.bin").read_bytes())
    data[entry.offset + 3] ^= 0xFF
    (snapshot / "data.bin").write_bytes(bytes(data))
    shutil.rmtree(copy / "checkpoints" / "4" / "state")
    assert load_params(copy).step == 2
    with pytest.raises(CheckpointError, match=f"run directory {copy}: no valid checkpoint for step 4"):
        load_params(copy, step=4)


@pytest.mark.slow
def test_a_paged_checkpoint_whose_layout_differs_is_refused(paged_run, monkeypatch):
    run_dir, _ = paged_run
    real = state_formats.params_layout  # as if the engine now laid the same model out in pages twice as large

    def doubled(cfg):
        return real(replace(cfg, memory=replace(cfg.memory, page_size=2 * cfg.memory.page_size)))

    monkeypatch.setattr(state_formats, "params_layout", doubled)
    with pytest.raises(StateMismatch, match=r"page layout rebuilt from the run's config differs .*stage 'embed'"):
        load_params(run_dir)
