"""A run directory that holds its run to the end: `train` and `launch` say so in one line, exit 0 and start nothing
(no model built, no worker spawned, no event written), and the watchdog's job_start line says what starts."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from angel_jax import cli
from angel_jax.tol.launch import _human, launch


@pytest.fixture(scope="module")
def finished(trained_tiny_run) -> tuple[Path, Path]:
    """(config, run directory) of the shared tiny run, trained to step 4 (conftest.py); nothing here changes it."""
    run_dir = trained_tiny_run("in_memory")[0]
    return run_dir.parent / f"{run_dir.name}.yaml", run_dir


def _files(run_dir: Path) -> dict[str, int]:
    return {str(p.relative_to(run_dir)): p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}


def test_train_into_a_finished_run_says_so_and_trains_nothing(finished, capsys):
    config, run_dir = finished
    before = _files(run_dir)
    assert cli.main(["train", str(config), "train.steps=4"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [f"{run_dir} holds a finished run (step 4 of 4): nothing to train. To train more, raise "
                   "train.steps (e.g. train.steps=8); to start over, train.resume=false (the old checkpoints are "
                   "moved aside) or another train.run_dir"]
    assert _files(run_dir) == before


def test_a_run_past_train_steps_is_finished_too(finished, capsys):
    config, run_dir = finished
    assert cli.main(["train", str(config), "train.steps=3"]) == 0
    assert "holds a finished run (step 4, past train.steps=3): nothing to train" in capsys.readouterr().out


def test_launch_into_a_finished_run_starts_no_worker(finished):
    config, run_dir = finished
    before = _files(run_dir)
    out = io.StringIO()
    assert launch(config, ["train.steps=4"], workers=2, out=out) == 0
    assert out.getvalue().splitlines() == [f"{run_dir.absolute()} holds a finished run (step 4 of 4): nothing to "
                                           "train. To train more, raise train.steps (e.g. train.steps=8); to start "
                                           "over, train.resume=false (the old checkpoints are moved aside) or "
                                           "another train.run_dir"]
    assert _files(run_dir) == before  # no events.jsonl, logs/, watchdog.json or goodput.json


def test_the_job_start_line_says_what_starts():
    event = {"kind": "job_start", "time": 0.0, "workers": 2, "nodes": ["local0", "local1"], "steps": 600,
             "policy": {"max_restarts": 5}}
    assert _human(event).endswith("watchdog job_start: 2 worker(s) on local0, local1, to step 600, up to 5 restarts")
