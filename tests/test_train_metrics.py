"""Metric helpers (angel_jax.train.metrics): the throughput formula, device peaks, the JSONL sink."""

from __future__ import annotations

import re
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


def test_device_peak_of_this_cpu_is_its_stated_spec():
    """The same figure every time (a matmul measured on a busy machine gave half of it, and MFUs over 100%)."""
    peak = M.device_peak(jax.devices("cpu")[0])
    assert not peak.is_estimate and peak.source.startswith("cpu: ") and "GHz" in peak.source
    assert 1e9 < peak.flops_per_device < 1e15
    assert M.device_peak(jax.devices("cpu")[0]) == peak == M.device_peak(FakeDevice("cpu"))
    assert "0.333 TFLOP/s" in M.peak_line(M.Peak(332.8e9, peak.source)) and peak.source in M.peak_line(peak)


def _cpuinfo(processors: list[tuple[int, int]], flags: str, mhz: str = "2600.000",
             model: str = "Intel(R) Xeon(R) Processor") -> str:
    """A /proc/cpuinfo of (physical id, core id) per logical processor."""
    return "\n\n".join(f"processor\t: {i}\nmodel name\t: {model}\ncpu MHz\t\t: {mhz}\nphysical id\t: {phys}\n"
                       f"core id\t\t: {core}\nflags\t\t: fpu sse2 {flags}" for i, (phys, core) in
                       enumerate(processors)) + "\n\n"


def test_cpu_peak_is_cores_times_clock_times_flops_per_cycle(tmp_path):
    two = _cpuinfo([(0, 0), (0, 1)], "avx avx2 fma avx512f")
    peak = M.cpu_peak(cpuinfo=two, sys_root=tmp_path, usable={0, 1})
    assert peak.flops_per_device == 2 * 2.6e9 * 64 and not peak.is_estimate
    assert peak.source == ("cpu: 2 cores x 2.60 GHz (/proc/cpuinfo) x 64 float32 FLOP/cycle "
                           "(AVX-512: 2 FMA units x 16 lanes x 2)")
    # Two CPU devices (--cpu-devices 2) share the cores: each gets half.
    assert M.cpu_peak(2, cpuinfo=two, sys_root=tmp_path, usable={0, 1}).flops_per_device == 2.6e9 * 64
    # Hyperthreads share a core's units: 4 logical processors on 2 cores are 2 cores.
    smt = _cpuinfo([(0, 0), (0, 1), (0, 0), (0, 1)], "avx avx2 fma")
    assert M.cpu_peak(cpuinfo=smt, sys_root=tmp_path, usable={0, 1, 2, 3}).flops_per_device == 2 * 2.6e9 * 32
    # Only the processors this process may run on; a cgroup quota of 1.5 CPUs allows 2 cores of 4.
    four = _cpuinfo([(0, 0), (0, 1), (0, 2), (0, 3)], "avx")
    assert M.cpu_peak(cpuinfo=four, sys_root=tmp_path, usable={2}).flops_per_device == 2.6e9 * 16
    (tmp_path / "fs/cgroup").mkdir(parents=True)
    (tmp_path / "fs/cgroup/cpu.max").write_text("150000 100000\n")
    assert M.cpu_peak(cpuinfo=four, sys_root=tmp_path, usable={0, 1, 2, 3}).flops_per_device == 2 * 2.6e9 * 16
    # The cpufreq maximum (a turbo clock) wins over /proc/cpuinfo's; without either, the model name's.
    for cpu in range(4):
        (tmp_path / f"devices/system/cpu/cpu{cpu}/cpufreq").mkdir(parents=True)
        (tmp_path / f"devices/system/cpu/cpu{cpu}/cpufreq/cpuinfo_max_freq").write_text("3500000\n")
    assert "3.50 GHz (cpufreq maximum)" in M.cpu_peak(cpuinfo=four, sys_root=tmp_path, usable={0}).source
    named = _cpuinfo([(0, 0)], "avx", mhz="", model="Intel(R) Xeon(R) CPU E5-2680 v2 @ 2.80GHz")
    assert M.cpu_peak(cpuinfo=named, sys_root=tmp_path / "none", usable={0}).flops_per_device == 2.8e9 * 16
    # Nothing to state it from: None (device_peak then measures a matmul, marked as an estimate).
    assert M.cpu_peak(cpuinfo=_cpuinfo([(0, 0)], "", mhz="", model="?"), sys_root=tmp_path / "none") is None


def test_step_window_never_shows_a_step_faster_than_the_device_ran_it():
    """The loop runs one step ahead. A host that wakes late to a finished step (here every third one, 25 ms late:
    the cores were computing the next) sees the next one finished too: its own interval is almost nothing (the
    old per-interval figure: 1.5 ms against 20 ms steps, an MFU 13x too high). Over the window the figure stays
    within one step's share of the truth, and from a restart (no step in flight) it is never below it."""
    device_s, host_s, lag_s = 0.020, 0.001, 0.025
    dispatched, done, seen = {1: 0.0, 2: host_s}, {0: 0.0}, {0: 0.0}
    for k in range(1, 41):
        done[k] = max(done[k - 1], dispatched[k]) + device_s  # the device runs the steps in order, as dispatched
        # The host waits for step k after dispatching k + 1, and wakes 0.5 ms after it finished, or 25 ms late.
        seen[k] = max(done[k], dispatched[k + 1]) + (lag_s if k % 3 == 0 else 0.0005)
        dispatched[k + 2] = seen[k] + host_s
    intervals = [seen[k] - seen[k - 1] for k in range(1, 41)]
    assert min(intervals) < device_s / 10  # what the old figure showed for some steps
    window = M.StepWindow()
    figures = [window.add(i) for i in intervals]
    assert all(f >= device_s for f in figures[:M.STEP_WINDOW])  # windows from the restart: never faster
    assert all(f >= device_s * (1 - 1 / M.STEP_WINDOW) for f in figures)  # later: within one step's share
    window.restart()
    assert window.add(0.5) == 0.5


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


GPT_TINY = {"seq_len": 64, "d_model": 64, "n_layers": 2, "n_heads": 4}  # gpt_tiny (128, 128, 4) halved


def test_a_trained_gpt_tiny_logs_no_impossible_figure(tmp_path, write_tiny_config, capsys):
    """A few steps of gpt_tiny's model on this CPU: every logged MFU is in (0, 1] over the stated CPU peak, the
    banner says what that peak is, and the progress bar's last figure is the last record's (the mean over the
    recent steps), not one interval the host happened to see late."""
    from angel_jax.config import load_config
    from angel_jax.train.loop import train

    steps = 7
    path = write_tiny_config(tmp_path, model=GPT_TINY, train={"steps": steps, "batch_size": 8, "progress": True},
                             checkpoint={"every": 0, "at_end": False})
    train(load_config(path))
    out, err = capsys.readouterr()
    peak = M.device_peak(jax.devices()[0])
    assert M.peak_line(peak) in out
    records = M.read_jsonl(tmp_path / "run" / "metrics.jsonl")
    timed = [r for r in records if "perf/mfu" in r]
    assert [r["step"] for r in timed] == list(range(2, steps + 1))
    assert all(0 < r["perf/mfu"] <= 1 and r["perf/mfu_is_estimate"] == 0 for r in timed), timed
    # Every window here reaches back to the end of step 1 (no step in flight then): the last figure is the mean
    # over steps 2..7, as the records' own clock has it within the host's bookkeeping.
    last = timed[-1]
    span = records[-1]["time"] - records[0]["time"]
    assert 0.25 * span <= last["perf/step_time"] * (steps - 1) <= 4 * span + 0.01
    shown = re.findall(r"tok/s=(\d+), mfu=([0-9.]+)%", err)[-1]
    assert int(shown[0]) == round(last["perf/tokens_per_s"]) and float(shown[1]) == round(100 * last["perf/mfu"], 1)
    # stderr is not a terminal here: plain lines (every step at log_every=1), no \r bar
    assert "\r" not in err and re.findall(r"^tiny: step (\d+)/7", err, re.M) == [str(k) for k in range(1, 8)]
