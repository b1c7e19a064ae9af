"""Anomaly detection inside the trainer, end to end: injected faults, the guard, rollbacks that really rewind."""

from __future__ import annotations

import math

import numpy as np
import pytest

from angel_jax.config import load_config
from angel_jax.tee.events import read_events
from angel_jax.tol.faults import FaultHooks, InjectedFault, parse
from angel_jax.train import metrics as M
from angel_jax.train.loop import train

STEPS = 160
BAD_BATCH = 139  # global batch index: step 140 of a clean run, once the loss has settled (the detectors'
# robust z-scores are conservative while the loss is still falling fast)


def _run(write_tiny_config, directory, name, faults="", **sections):
    sections.setdefault("train", {})
    sections["train"] = {"steps": STEPS, **sections["train"]}
    # The step-time detector judges the machine, not the run: on a shared 2-core machine another process's load
    # once showed up as a step-time anomaly at step 72 among the data anomalies these tests count.
    sections.setdefault("anomaly", {"thresholds": {"step_time": {"enabled": False}}})
    cfg_path = write_tiny_config(directory, name, **sections)
    exact: dict[int, dict] = {}
    hooks = [FaultHooks.parse(faults)] if faults else []
    result = train(load_config(cfg_path), hooks=hooks, on_step=lambda s, v: exact.__setitem__(s, v))
    return result, exact, list(read_events(directory / name / "events.jsonl"))


@pytest.fixture(scope="module")
def corrupted(tmp_path_factory, write_tiny_config):
    d = tmp_path_factory.mktemp("corrupted")
    return _run(write_tiny_config, d, "run", f"corrupt_batch@{BAD_BATCH}")


@pytest.fixture(scope="module")
def clean_without_window(tmp_path_factory, write_tiny_config, corrupted):
    """A clean run that never trains on the window the rollback skipped."""
    window = [e for e in corrupted[2] if e["kind"] == "rollback"][0]["skipped_batches"]
    d = tmp_path_factory.mktemp("clean")
    return _run(write_tiny_config, d, "run", data={"skip_batches": [window]})


@pytest.mark.slow
def test_corrupted_batch_is_detected_and_rolled_back(corrupted):
    _, exact, events = corrupted
    anomalies = {e["detector"]: e for e in events if e["kind"] == "anomaly"}
    assert {e["step"] for e in anomalies.values()} == {140}, anomalies
    assert anomalies["loss_spike"]["requested"] == "rollback"
    [rollback] = [e for e in events if e["kind"] == "rollback"]
    # back to the checkpoint of step 130; the batches of steps 131..140 (global 130..139) are never trained on
    assert (rollback["step"], rollback["to_step"], rollback["skipped_batches"]) == (140, 130, [130, 139])
    assert rollback["tier"] == "memory"
    assert sorted(exact) == list(range(1, STEPS + 1))  # every step reported once, the abandoned one never
    assert all(math.isfinite(v["loss"]) and v["loss"] < 1.5 * exact[130]["loss"] for s, v in exact.items() if s > 130)


@pytest.mark.slow
def test_rollback_really_rewinds(corrupted, clean_without_window):
    """The rolled-back run ends exactly where a clean run that skipped the same window from the start ends."""
    result, exact, _ = corrupted
    clean, clean_exact, clean_events = clean_without_window
    assert not [e for e in clean_events if e["kind"] in ("anomaly", "rollback")]
    assert exact[STEPS]["loss"] == pytest.approx(clean_exact[STEPS]["loss"], rel=1e-6)
    for step in range(131, STEPS + 1):
        assert exact[step]["loss"] == pytest.approx(clean_exact[step]["loss"], rel=1e-6), step
    for a, b in zip(_leaves(result.params), _leaves(clean.params)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # the metrics file reads like the surviving trajectory: one line per step
    records = M.read_jsonl(result.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_nan_batch_is_dropped_on_the_device_and_rolled_back(tmp_path, write_tiny_config):
    result, exact, events = _run(write_tiny_config, tmp_path, "nan", f"nan_batch@{BAD_BATCH}")
    [nan] = [e for e in events if e["kind"] == "anomaly"]
    assert (nan["detector"], nan["step"], nan["requested"]) == ("nan", 140, "rollback")
    [rollback] = [e for e in events if e["kind"] == "rollback"]
    assert rollback["skipped_batches"] == [130, 139]
    assert all(math.isfinite(v["loss"]) for v in exact.values())


@pytest.mark.slow
def test_lr_blowup_updates_are_skipped_by_the_guard(tmp_path, write_tiny_config):
    """A 3-step learning-rate blow-up: each update is far larger than usual; the guard drops it on the device
    (update_spike: skip), so the parameters never see it and training goes on healthy."""
    result, exact, events = _run(write_tiny_config, tmp_path, "lr", "lr_blowup@140:steps=3:scale=1000")
    spikes = [e for e in events if e["kind"] == "anomaly"]
    assert {e["step"] for e in spikes} == {140, 141, 142}
    assert {e["detector"] for e in spikes} == {"update_spike"} and all(e["taken"] == "skipped" for e in spikes)
    assert [s for s, v in exact.items() if v["anomaly/skipped"]] == [140, 141, 142]
    assert not [e for e in events if e["kind"] == "rollback"]
    assert exact[STEPS]["loss"] < exact[139]["loss"] * 1.1


@pytest.mark.slow
def test_a_fault_raised_inside_a_step_stops_the_run_after_committing(tmp_path, write_tiny_config):
    with pytest.raises(InjectedFault, match="raise@23"):
        _run(write_tiny_config, tmp_path, "raise", "raise@23")
    # the checkpoint of step 20 was committed before the exception left train()
    assert (tmp_path / "raise" / "checkpoints" / "20").is_dir()


def test_fault_specs_parse_and_reject_nonsense():
    [f] = parse("slow@20:factor=2.5:rank=1:attempt=0")
    assert (f.kind, f.at, f.params, f.rank, f.attempt) == ("slow", 20, {"factor": 2.5}, 1, 0)
    assert [g.kind for g in parse("nan_batch@3, leak@9:mib=8")] == ["nan_batch", "leak"]
    for bad in ("explode@3", "slow@x", "slow@3:speed=2", "leak@3:mib"):
        with pytest.raises(ValueError, match="fault"):
            parse(bad)
    assert FaultHooks(parse("raise@3:rank=1"), rank=0).faults == []
    assert FaultHooks(parse("raise@3:attempt=0"), attempt=1).faults == []


def _leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]
