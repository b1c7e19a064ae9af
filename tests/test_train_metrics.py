"""Metric helpers (angel_jax.train.metrics): the throughput formula, device peaks, the JSONL sink."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import pytest

from angel_jax.train import metrics as M
from test_train_loop import PERF_KEYS


def test_throughput_formula():
    peak = M.Peak(1e15, "table:test")
    got = M.throughput(step_time=0.5, tokens_per_step=1000, flops_per_token=6e9, peak=peak, n_devices=2)
    assert set(got) == set(PERF_KEYS)
    assert got["perf/step_time"] == 0.5
    assert got["perf/tokens_per_s"] == 2000.0
    # 6e9 FLOP/token * 1000 tokens / 0.5 s = 1.2e13 FLOP/s = 12 TFLOP/s; peak 2 devices x 1e15
    assert got["perf/tflops"] == pytest.approx(12.0, rel=1e-12)
    assert got["perf/mfu"] == pytest.approx(1.2e13 / 2e15, rel=1e-12)
    one = M.throughput(0.25, 4096, 1e6, M.Peak(4e9, "table:x"), 1)
    assert one["perf/tokens_per_s"] == 16384.0 and one["perf/mfu"] == pytest.approx(16384 * 1e6 / 4e9, rel=1e-12)


@dataclass
class FakeDevice:
    device_kind: str


@pytest.mark.parametrize("kind, flops, key", [
    ("NVIDIA H100 80GB HBM3", 989e12, "H100"),
    ("NVIDIA H100 PCIe", 756e12, "H100 PCIe"),
    ("NVIDIA H200", 989e12, "H200"),
    ("NVIDIA GH200 480GB", 989e12, "GH200"),
    ("NVIDIA A100-SXM4-80GB", 312e12, "A100"),
    ("NVIDIA L40S", 362e12, "L40S"),
    ("NVIDIA L4", 121e12, "L4"),
    ("TPU v5 lite", 197e12, "TPU v5 lite"),
])
def test_device_peak_from_the_table(kind, flops, key):
    peak = M.device_peak(FakeDevice(kind))
    assert peak == M.Peak(flops, f"table:{key}") and not peak.is_estimate


def test_device_peak_of_a_cpu_is_a_measured_estimate():
    peak = M.device_peak(jax.devices("cpu")[0])
    assert peak.is_estimate and peak.source == "estimate:matmul"
    assert 1e6 < peak.flops_per_device < 1e15
    assert M.device_peak(FakeDevice("cpu")).is_estimate


def test_device_peak_does_not_match_a_prefix_of_another_device():
    assert M.device_peak(FakeDevice("NVIDIA L40")).source != "table:L4"


def test_jsonl_sink_truncates_after_the_resume_step(tmp_path):
    path = tmp_path / "m.jsonl"
    sink = M.JsonlSink(path)
    for step in range(1, 6):
        sink.write(step, {"loss": float(step)})
    sink.close()
    with open(path, "a") as f:
        f.write('{"step": 6, "loss"')  # a line cut short by a kill
    sink = M.JsonlSink(path, resume_step=3)
    sink.write(4, {"loss": 40.0})
    sink.close()
    assert [(r["step"], r["loss"]) for r in M.read_jsonl(path)] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]


def test_every_sink_goes_back_after_a_rollback(tmp_path):
    """The loop calls truncate_after on every sink after a rollback: the JSONL file drops the later records (they
    are written again), the TensorBoard sink takes the call and goes on writing."""
    path = tmp_path / "m.jsonl"
    sinks: list[M.MetricsSink] = [M.JsonlSink(path)]
    pytest.importorskip("tensorboardX")
    sinks.append(M.TensorBoardSink(tmp_path / "tb"))
    for sink in sinks:
        for step in range(1, 6):
            sink.write(step, {"loss": float(step)})
        sink.truncate_after(2)
        sink.write(3, {"loss": 30.0})
        sink.close()
    assert [(r["step"], r["loss"]) for r in M.read_jsonl(path)] == [(1, 1.0), (2, 2.0), (3, 30.0)]
