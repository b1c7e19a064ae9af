"""A diverging run (angel_jax.train.loop with the anomaly monitor): rolled back, then stopped with an error naming
the step, through `angel-jax train` in this process; and a run stopped by updates dropped in a row.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from angel_jax import cli
from angel_jax.train import loop
from angel_jax.train import metrics as M
from angel_jax.tee.events import read_events
from angel_jax.train.loop import TrainingDiverged
from test_train_loop import _committed_steps, _train

# SGD with an absurd learning rate: step 1's update takes the parameters to ~1e28, step 2's loss is NaN.
DIVERGE = {"name": "sgd", "lr": 1e30, "grad_clip": 0.0, "warmup_steps": 0}


def _cli(argv: list[str]) -> tuple[int, str, str]:
    """cli.main in this process: (exit code, stdout, stderr); the root logger is restored afterwards."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main(argv)
    finally:
        for h in root.handlers[:]:
            if h not in handlers:
                root.removeHandler(h)
        root.setLevel(level)
    return rc, out.getvalue(), err.getvalue()


@dataclass
class Diverged:
    run_dir: Path
    rc: int
    err: str
    error: BaseException
    seen: list[int]
    """Steps whose numbers on_step received (all finite)."""
    committed: list[int]
    """Committed checkpoint steps at the moment train() raised."""


@pytest.fixture(scope="module")
def diverged(tmp_path_factory, write_tiny_config) -> Diverged:
    """`angel-jax train` (cli.main, in this process) on a diverging config that checkpoints every step; a spy
    around loop.train keeps the exception and the checkpoints committed when it was raised."""
    directory = tmp_path_factory.mktemp("diverged")
    cfg_path = write_tiny_config(directory, "nan", optimizer=DIVERGE, train={"steps": 10},
                                 checkpoint={"every": 1, "keep": 5})
    real_train, caught, seen = loop.train, {}, []

    def spy(cfg, *, hooks=(), on_step=None):
        try:
            return real_train(cfg, hooks=hooks, on_step=lambda step, values: seen.append(step))
        except BaseException as e:
            caught["committed"] = _committed_steps(cfg.run_dir)
            caught["error"] = e
            raise

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loop, "train", spy)  # cli imports loop.train when the command runs
        rc, _, err = _cli(["train", str(cfg_path)])
    assert "error" in caught, err[-3000:]
    return Diverged(directory / "nan", rc, err, caught["error"], seen, caught["committed"])


@pytest.mark.slow
def test_divergence_is_rolled_back_then_stops_naming_the_step(diverged):
    """lr=1e30: every update overflows (update_norm inf) from step 1. The guard drops it on the device, the NaN
    detector asks for a rollback (to the initial state: no checkpoint yet), the bad batch is skipped, and after
    anomaly.max_rollbacks (3) rollbacks the run stops with an error naming the step."""
    assert isinstance(diverged.error, TrainingDiverged)
    assert re.match(r"step 1: the anomaly came back after 3 rollbacks to step 0", str(diverged.error)), diverged.error
    assert diverged.seen == []  # no step's figures were accepted
    assert not (diverged.run_dir / "metrics.jsonl").exists() or M.read_jsonl(diverged.run_dir / "metrics.jsonl") == []
    assert diverged.committed == []  # nothing good to checkpoint
    events = list(read_events(diverged.run_dir / "events.jsonl"))
    nans = [e for e in events if e["kind"] == "anomaly"]
    assert len(nans) == 4 and {e["detector"] for e in nans} == {"nan"} and all(e["step"] == 1 for e in nans)
    assert all(e["requested"] == "rollback" and "inf" in e["message"] for e in nans)
    rollbacks = [e for e in events if e["kind"] == "rollback"]
    assert [e["skipped_batches"] for e in rollbacks] == [[0, 0], [1, 1], [2, 2]]
    assert all(e["to_step"] == 0 and e["tier"] == "initial state" for e in rollbacks)


@pytest.mark.slow
def test_cli_divergence_returns_1_with_the_message(diverged):
    assert diverged.rc == 1
    assert f"error: {diverged.error}\n" in diverged.err and "Traceback" not in diverged.err


@pytest.mark.slow
def test_updates_dropped_in_a_row_stop_the_run(tmp_path, write_tiny_config):
    """With nan: skip, the guard drops every overflowing update and the run stops after max_consecutive_skips."""
    cfg_path = write_tiny_config(tmp_path, "skips", optimizer=DIVERGE, train={"steps": 30},
                                 anomaly={"actions": {"nan": "skip"}, "max_consecutive_skips": 5})
    with pytest.raises(TrainingDiverged, match=r"step 5: 5 updates in a row were dropped"):
        _train(cfg_path)
    skipped = [e for e in read_events(tmp_path / "skips" / "events.jsonl") if e["kind"] == "anomaly"]
    assert [(e["step"], e["taken"]) for e in skipped] == [(s, "skipped") for s in range(1, 6)]
