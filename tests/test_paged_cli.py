"""`angel-jax plan` and the GPU benchmark's CPU smoke run: real commands, real files."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from angel_jax import cli
from angel_jax.schedule.timeline import Timeline
from conftest import REPO_ROOT


def test_plan_prints_the_page_table_and_writes_the_predicted_timeline(tmp_path, capsys):
    config = REPO_ROOT / "experiments" / "gpt_tiny.yaml"
    overrides = ["memory.page_size=262144", "memory.device_budget=24000000", "train.batch_size=8"]
    assert cli.main(["plan", str(config), *overrides, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "predicted step time" in out and "predicted peak bytes" in out and "I/O per step" in out
    assert "host updates          the fused host kernel (adamw), on every core" in out
    rows = {line.split()[0]: line for line in out.splitlines()
            if line.strip().startswith(("device ", "host ", "disk "))}
    assert set(rows) == {"device", "host", "disk"}, out
    summary = json.loads((tmp_path / "plan.json").read_text())
    assert summary["streamed"] > 0 and summary["resident"] > 0, summary  # the budget splits the model
    assert summary["peak_bytes"]["device"] <= 24_000_000
    io = summary["io_per_step"]
    assert io["h2d_bytes"] >= 2 * io["d2h_bytes"] - max(s["param_bytes"] for s in summary["stages"]) > 0
    assert sum(r["params"] for r in summary["table"]) >= 4 * 128 * 128 * 12 * 4  # every block's parameters
    timeline = Timeline.from_json(json.loads((tmp_path / "timeline_predicted.json").read_text()))
    assert timeline.step_time == summary["predicted_step_s"] > 0
    starts = timeline.step_starts  # the simulated steps' starts, which the chart marks
    assert len(starts) == 3 and starts == sorted(starts) and starts[-1] - starts[-2] <= timeline.step_time + 1e-9
    assert {"compute", "h2d", "d2h", "host"} <= {e.stream for e in timeline.events}
    assert (tmp_path / "timeline_predicted.png").stat().st_size > 1000


def test_plan_names_the_key_to_raise_when_memory_is_missing(tmp_path, capsys):
    config = REPO_ROOT / "experiments" / "gpt_tiny.yaml"
    rc = cli.main(["plan", str(config), "memory.page_size=262144", "memory.device_budget=1000000", "--estimate",
                   "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 1
    assert "B missing" in err and "memory.device_budget" in err, err
    assert not (tmp_path / "plan.json").exists()


def test_plan_estimates_a_model_far_larger_than_this_machine(tmp_path, capsys):
    config = REPO_ROOT / "experiments" / "gpt_13b.yaml"
    assert cli.main(["plan", str(config), "memory.device_budget=80000000000", "--estimate", "--peak-tflops", "989",
                     "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "plan.json").read_text())
    assert summary["streamed"] > 0 and summary["peak_bytes"]["host"] > 80e9, summary
    assert "--peak-tflops" in summary["source"]


def test_gpu_benchmark_smoke_runs_on_the_cpu(tmp_path):
    script = REPO_ROOT / "experiments" / "bench" / "paged_gpu.py"
    # The plumbing, not the speed: compiled without XLA's backend optimisations (the run takes about a fifth less).
    flags = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), "--xla_backend_optimization_level=0"]))
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
    proc = subprocess.run(["timeout", "-s", "KILL", "300", sys.executable, str(script), "--smoke",
                           "--disk-dir", str(tmp_path)], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"bench')]
    figures = {d["figure"]: d for d in map(json.loads, lines)}
    assert set(figures) == {"fits_auto", "quarter_state", "ladder", "beyond_hbm"}, proc.stdout[-2000:]
    quarter = figures["quarter_state"]
    assert quarter["streamed"] == quarter["stages"] and quarter["reference_tokens_per_s"] > 0
    assert quarter["paged_over_reference"] > 0
    assert figures["fits_auto"]["auto_picked"] == "in_memory"
    assert figures["fits_auto"]["paged_resident_stages"] == "4/4"
    largest = figures["ladder"]["largest"]
    assert set(largest) == {"reference", "paged_host", "paged_disk"}, figures["ladder"]["rungs"]
    disk_rung = [r for r in figures["ladder"]["rungs"] if r["mode"] == "paged_disk"][0]
    assert disk_rung["opt_on_disk"] > 0 and disk_rung["streamed"] == disk_rung["stages"]
    beyond = figures["beyond_hbm"]
    assert beyond["ok"] and beyond["layers"] == 2 * largest["reference"]["layers"] and beyond["tokens_per_s"] > 0
    assert not (REPO_ROOT / "experiments" / "results" / "paged_gpu_cpu.jsonl").exists(), "a smoke run saves nothing"


def test_a_run_larger_than_the_machine_stops_at_once_with_one_line(tmp_path):
    """A 26 B-parameter GPT on a 50 GB disk tier: refused from the page layouts' bytes in seconds, with one line
    naming the bytes and the key, and without allocating the model (the process stays small)."""
    config = REPO_ROOT / "experiments" / "gpt_tiny.yaml"
    (tmp_path / "disk").mkdir()
    overrides = ["model.d_model=4096", "model.n_heads=32", "model.n_layers=128", "model.seq_len=128",
                 "train.batch_size=1", "memory.mode=paged",
                 f"memory.disk_dir={tmp_path / 'disk'}", "memory.disk_budget=50000000000",
                 "memory.device_budget=4000000000", "memory.host_budget=16000000000",
                 f"train.run_dir={tmp_path / 'run'}", f"checkpoint.memory_dir={tmp_path / 'mem'}"]
    # The tunable set and the block cache off: the CLI does not restart itself (memory/malloc.py), so the wrapper
    # below measures it.
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO_ROOT), GLIBC_TUNABLES="glibc.malloc.hugetlb=1",
               ANGEL_JAX_BLOCK_CACHE="0")
    peak_file = tmp_path / "maxrss_kib"
    run_cli = ("import resource, runpy, sys\n"
               "try:\n    runpy.run_module('angel_jax.cli', run_name='__main__')\n"
               f"finally:\n    open({str(peak_file)!r}, 'w').write(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))")
    proc = subprocess.run(["timeout", "-s", "KILL", "300", sys.executable, "-c", run_cli, "train", str(config),
                           *overrides], env=env, capture_output=True, text=True)
    peak_kib = int(peak_file.read_text())
    assert proc.returncode not in (0, -9), proc.stderr[-2000:]
    # Refused from the config's numbers (the state, 384 GiB, is past device + host + the disk budget), or, when
    # this host's tiers together could hold it, from the page layouts (the disk budget the plan needs).
    errors = [line for line in proc.stderr.splitlines()
              if "need the disk tier" in line or "more than all it has" in line]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert ("give the disk tier more than 50,000,000,000 B" in errors[0]
            or ("384.14 GiB" in errors[0] and "memory.disk_budget" in errors[0])), errors[0]
    assert peak_kib < 2 * 1024 * 1024, f"peak RSS {peak_kib} KiB: the model was allocated"
    assert not any((tmp_path / "disk").rglob("c.*")), "nothing may be written to the disk tier"
