"""The machine an estimated plan is for (train/plan_target.py): a target named by a calibration file, a peak or its
links takes nothing from the machine the plan is made on; the committed H200 calibration is what its builder makes
of the committed measurements; stage times follow the calibrated compute rate, MFU the datasheet peak."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from angel_jax.config import load_config
from angel_jax.errors import AngelError
from angel_jax.schedule.blueprint import blueprint
from angel_jax.cli.plan import _estimated_plan, _parser
from angel_jax.train.plan_target import plan_target

ROOT = Path(__file__).resolve().parents[1]
H200 = ROOT / "experiments" / "results" / "h200_calibration.json"
OVERRIDES = ["model.n_layers=4", "train.batch_size=8", "memory.device_budget=12000000", "memory.page_size=262144"]


def _local_calibration(directory: Path, gbps: float) -> None:
    """An `angel-jax bench io` calibration of "this machine" with every link at `gbps` and a CPU cost per byte."""
    directory.mkdir(parents=True, exist_ok=True)
    figures = {k: gbps * 1e9 for k in ("h2d_pinned", "d2h_pinned", "disk_read", "disk_write", "host_memcpy",
                                        "device_copy")}
    (directory / "io_calibration.json").write_text(json.dumps(
        {"bandwidth_Bps": figures, "cpu_s_per_byte": {"disk_read": 1e-9, "disk_write": 1e-9},
         "machine": {"cpu_count": 2}}))


def _plan(monkeypatch, cache: Path, *flags: str) -> tuple[dict, str]:
    monkeypatch.setenv("ANGEL_JAX_CACHE_DIR", str(cache))
    cfg = load_config(ROOT / "experiments" / "gpt_tiny.yaml", OVERRIDES)
    args = _parser().parse_args(["unused.yaml", "--estimate", *flags])
    _, plan, costs, _, bw, source = _estimated_plan(cfg, blueprint(cfg), args)
    return {"summary": plan.summary(), "step": plan.predicted.step_time, "costs": costs, "bw": bw}, source


@pytest.mark.parametrize("flags", [("--calibration", str(H200)), ("--peak-tflops", "989"),
                                   ("--peak-tflops", "989", "--h2d-gbps", "25")])
def test_a_named_target_plans_alike_from_machines_with_other_calibrations(monkeypatch, tmp_path, flags):
    slow, fast = tmp_path / "slow", tmp_path / "fast"
    _local_calibration(slow, 0.5)
    _local_calibration(fast, 40.0)
    a, source = _plan(monkeypatch, slow, *flags)
    b, _ = _plan(monkeypatch, fast, *flags)
    assert a == b and a["summary"]["streamed"] > 0  # (streamed stages: the links are in the plan)
    assert "this machine" not in source


def test_with_no_target_named_the_plan_is_this_machines(monkeypatch, tmp_path):
    """The converse, so that the test above can fail: with no target the two machines' calibrations do count."""
    _local_calibration(tmp_path / "slow", 0.5)
    _local_calibration(tmp_path / "fast", 40.0)
    a, source = _plan(monkeypatch, tmp_path / "slow")
    b, _ = _plan(monkeypatch, tmp_path / "fast")
    assert a["bw"] != b["bw"] and a["step"] != b["step"] and "this machine" in source


def test_stage_times_follow_the_calibrated_rate_and_links(monkeypatch, tmp_path):
    cal = json.loads(H200.read_text())
    args = _parser().parse_args(["unused.yaml", "--estimate", "--calibration", str(H200), "--disk-read-gbps", "3"])
    target = plan_target(args)
    assert target.compute_flops == cal["compute_flops"] < target.peak.flops_per_device == cal["peak_flops"]
    assert target.host_bw == cal["bandwidth_Bps"]["host_update"]
    assert target.bandwidths.h2d == cal["bandwidth_Bps"]["h2d_pinned"]
    assert target.bandwidths.disk_read == 3e9 and target.sources["disk read"] == "3 GB/s (--disk-read-gbps)"
    assert target.bandwidths.disk_read_cpu == target.bandwidths.disk_write_cpu == 0.0  # the target's host cores
    with_cal, _ = _plan(monkeypatch, tmp_path, "--calibration", str(H200))
    at_peak, _ = _plan(monkeypatch, tmp_path, "--peak-tflops", str(cal["peak_flops"] / 1e12))
    block = next(i for i, c in enumerate(with_cal["costs"]) if c.name.startswith("block"))
    ratio = with_cal["costs"][block].forward_s / at_peak["costs"][block].forward_s
    # (per row: each plan chooses its own micro-batch size, and a stage call's time is one micro-batch's)
    rows = with_cal["summary"]["micro_batches"] / at_peak["summary"]["micro_batches"]
    assert ratio * rows == pytest.approx(cal["peak_flops"] / cal["compute_flops"], rel=1e-9)


def test_a_file_that_is_not_a_calibration_is_refused_naming_what_is_missing(tmp_path):
    bad = tmp_path / "io.json"
    bad.write_text(json.dumps({"bandwidth_Bps": {"h2d_pinned": 1e9}}))
    with pytest.raises(AngelError, match=r"not a target calibration \(missing peak_flops, compute_flops, "
                                         r"bandwidth_Bps.d2h_pinned"):
        plan_target(_parser().parse_args(["unused.yaml", "--estimate", "--calibration", str(bad)]))
    with pytest.raises(AngelError, match="cannot read it as JSON"):
        plan_target(_parser().parse_args(["unused.yaml", "--estimate", "--calibration", str(tmp_path / "none")]))


def test_the_committed_h200_calibration_is_what_its_builder_makes_of_the_committed_measurements():
    sys.path.insert(0, str(ROOT / "experiments" / "bench"))
    try:
        import calibration
    finally:
        sys.path.remove(str(ROOT / "experiments" / "bench"))
    assert calibration.build("NVIDIA H200") == json.loads(H200.read_text())


def test_the_targets_device_memory_is_the_device_budget_where_the_config_sets_none(monkeypatch, tmp_path):
    monkeypatch.setenv("ANGEL_JAX_CACHE_DIR", str(tmp_path))
    cfg = load_config(ROOT / "experiments" / "gpt_tiny.yaml", ["model.n_layers=4", "train.batch_size=8"])
    args = _parser().parse_args(["unused.yaml", "--estimate", "--calibration", str(H200)])
    budgets = _estimated_plan(cfg, blueprint(cfg), args)[3]
    assert budgets.device == json.loads(H200.read_text())["device_memory_bytes"]


def test_what_if_plans_updates_one_step_behind_and_narrower_state(monkeypatch, tmp_path, capsys):
    """`--what-if` plans the same target with each setting the config lacks and with all, and says which bounds
    each: here a step bound by host updates gets shorter with them one step behind."""
    from angel_jax.cli.plan import main

    monkeypatch.setenv("ANGEL_JAX_CACHE_DIR", str(tmp_path / "cache"))
    config = ROOT / "experiments" / "gpt_tiny.yaml"
    args = [str(config), *OVERRIDES, "model.compute_dtype=bfloat16", "--estimate", "--calibration", str(H200),
            "--what-if", "--out", str(tmp_path / "out")]
    assert main(args) == 0
    printed = capsys.readouterr().out
    what_if = json.loads((tmp_path / "out" / "plan.json").read_text())["what_if"]
    assert set(what_if) == {"updates one step behind", "bfloat16 parameters over a float32 master",
                            "bfloat16 optimizer moments", "streamed stages updated on the device",
                            "stage inputs parked in host memory", "all of them"}
    assert what_if["all of them"]["overrides"] == ["memory.staleness=1", "model.param_dtype=bfloat16",
                                                   "optimizer.master_weights=true", "optimizer.state_dtype=bfloat16",
                                                   "memory.streamed_updates=device", "memory.activations=host"]
    exact = json.loads((tmp_path / "out" / "plan.json").read_text())["predicted_step_s"]
    assert what_if["updates one step behind"]["staleness"] == 1
    assert what_if["updates one step behind"]["predicted_step_s"] < exact
    for name, result in what_if.items():  # (a setting no plan fits is named with the refusal)
        assert f"{name} (" in printed and result["bound"] in printed if "refused" not in result \
            else f"{name}: no plan fits (" in printed
    # This device budget holds no stage's update pages beside the window: refused, saying what to raise.
    assert "memory.streamed_updates=host" in what_if["streamed stages updated on the device"]["refused"]
    # Float32 compute crosses float32: bfloat16 parameters are not tried; a setting the config has is not tried
    # again.
    assert main([str(config), *OVERRIDES, "memory.staleness=1", "optimizer.state_dtype=bfloat16",
                 "memory.streamed_updates=device", "memory.activations=host", "memory.device_budget=20000000",
                 "--estimate",
                 "--calibration", str(H200), "--what-if", "--out", str(tmp_path / "out2")]) == 0
    assert "already has every setting" in capsys.readouterr().out
    with pytest.raises(AngelError, match="--what-if .*--estimate"):
        main([str(config), *OVERRIDES, "--what-if", "--out", str(tmp_path / "out3")])
