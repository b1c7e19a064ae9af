"""The pictures a run leaves: loss.png beside metrics.jsonl (redrawn at evaluations, checkpoints and the end),
`angel-jax plot` over several runs, and the timelines' Gantt charts (step boundaries, a legend, one time scale for
the predicted and the measured chart, a title that says what is drawn). Real runs, real files."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from angel_jax import cli
from angel_jax.schedule.timeline import Timeline, save_pngs
from angel_jax.train.curves import PNG_NAME, Curve, LossCurves, draw, read_curve

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny_run(trained_tiny_run) -> Path:
    """The shared tiny in-memory run: 2 steps, then resumed to 4, a checkpoint every 2 (conftest.py)."""
    return trained_tiny_run("in_memory")[0]


def test_a_run_writes_its_loss_curve_beside_its_metrics(tiny_run):
    png = tiny_run / PNG_NAME
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 5000
    assert not list(tiny_run.glob(".*.tmp"))  # written whole, then renamed


def test_a_resumed_run_draws_the_steps_of_its_earlier_process(tiny_run, tmp_path):
    # The second run's hook read steps 1-2 from metrics.jsonl; drawn again from the file for the comparison.
    hook = LossCurves(tiny_run, name="tiny", total_steps=4)
    hook.on_step(3, {"loss": 1.0})
    assert list(hook.curve.steps) == [1, 2, 3] and list(hook.curve.loss)[:2] == list(read_curve(tiny_run).loss)[:2]


def test_plot_draws_several_runs_on_one_chart(tiny_run, tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 6.0 - s}) + "\n" for s in (1, 2, 3)))
    out = tmp_path / "both.png"
    assert cli.main(["plot", str(tiny_run), str(other), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert f"{tiny_run.name}: 4 logged steps" in printed and "other: 3 logged steps, the last step 3, loss 3.0000" in printed
    (other / "metrics.jsonl").open("a").write(json.dumps({"step": 3, "eval/loss": 3.5}) + "\n")
    labels = draw([read_curve(tiny_run, "run"), read_curve(other, "other")], tmp_path / "again.png", "t")
    assert labels == ["run: train loss", "other: train loss", "other: eval loss"]


def test_plot_of_a_directory_without_metrics_is_one_line(tmp_path, capsys):
    assert cli.main(["plot", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {tmp_path} has no metrics.jsonl: not a run directory (`angel-jax train` writes "
                   "metrics.jsonl there)"]


def test_a_resumed_run_draws_its_earlier_steps_and_a_rollback_redraws_the_recomputed_ones(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0 - s / 10}) + "\n"
                                                    for s in (1, 2, 3, 4)))
    hook = LossCurves(tmp_path, name="r", total_steps=9)
    hook.on_step(3, {"loss": 1.0})  # resumed from step 2's checkpoint: steps 3 and 4 of the file are recomputed
    hook.on_step(4, {"loss": 0.9, "eval/loss": 1.2})
    hook.on_step(5, {"loss": 0.8})
    hook.on_step(4, {"loss": 0.7})  # rolled back to step 3
    assert list(hook.curve.steps) == [1, 2, 3, 4] and list(hook.curve.loss) == [4.9, 4.8, 1.0, 0.7]
    assert list(hook.curve.eval_steps) == []
    hook.close()
    assert (tmp_path / PNG_NAME).read_bytes()[:8] == PNG_MAGIC


def test_a_loss_curve_that_cannot_be_drawn_is_one_warning_and_no_more_attempts(tmp_path, caplog):
    (tmp_path / PNG_NAME).mkdir()  # the picture's path is taken by a directory
    hook = LossCurves(tmp_path, name="r", total_steps=4)
    with caplog.at_level(logging.WARNING, logger="angel_jax.train.curves"):
        hook.on_step(1, {"loss": 2.0, "eval/loss": 2.1})
        hook.on_checkpoint(1, {})
        hook.on_step(2, {"loss": 1.9})
        hook.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "could not draw the loss curve" in warnings[0], warnings
    assert "training goes on without it" in warnings[0]


def _timeline(steps: int, step_s: float) -> Timeline:
    t = Timeline(step_time=step_s, step_starts=[k * step_s for k in range(steps)])
    for k in range(steps):
        t.add("compute", "forward s0", k * step_s, k * step_s + step_s / 2)
        t.add("h2d", "fetch s0", k * step_s, k * step_s + step_s / 10)
        t.add("compute", "backward s0", k * step_s + step_s / 2, (k + 1) * step_s)
    return t


def test_the_predicted_and_the_measured_timeline_share_one_time_scale(tmp_path):
    _timeline(3, 22.1135).save_json(tmp_path / "timeline_predicted.json")
    assert save_pngs(tmp_path, "m") == {"predicted": pytest.approx(3 * 22.1135)}
    _timeline(2, 1.2).save_json(tmp_path / "timeline_measured.json")
    covered = save_pngs(tmp_path, "m")
    assert covered == {"predicted": pytest.approx(3 * 22.1135), "measured": pytest.approx(3 * 22.1135)}
    for kind in covered:
        assert (tmp_path / f"timeline_{kind}.png").read_bytes()[:8] == PNG_MAGIC


def test_a_timeline_title_says_how_many_steps_it_shows_and_how_long_one_takes():
    timeline = Timeline.from_json(json.loads(json.dumps(_timeline(3, 22.1135).to_json())))
    assert timeline.step_starts == pytest.approx([0.0, 22.1135, 44.227])
    assert timeline._steps_text(1.0, "s") == "3 steps shown (66.3 s); one step 22.1 s in the steady state (start to start)"
