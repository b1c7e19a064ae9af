"""Benchmark scripts (experiments/bench/) write into the committed results only when asked: a user trying one
leaves `git status` clean."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess

from conftest import REPO_ROOT

BENCH = REPO_ROOT / "experiments" / "bench"


def _tracked_scripts() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "experiments/bench/*.py"], cwd=REPO_ROOT, capture_output=True,
                            text=True, check=True).stdout.split()
    return [name for name in listed if name.endswith(".py")]


def test_every_script_that_writes_results_does_so_behind_write():
    """A script that can append to experiments/results/ has a --write flag (no --no-save opting out), and passes
    the results path on only when it is set."""
    writers = []
    for name in _tracked_scripts():
        text = (REPO_ROOT / name).read_text()
        if not re.search(r"results_path\(|RESULTS|\"results\"", text):
            continue
        writers.append(name)
        assert '"--no-save"' not in text, f"{name}: writes results unless told not to"
        assert '"--write"' in text, f"{name}: no --write flag"
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if "results_path(" in line and "import" not in line and "def " not in line:
                context = "\n".join(lines[max(0, i - 3):i + 1])
                assert "write" in context, f"{name}:{i + 1}: results written regardless: {line.strip()}"
    assert len(writers) >= 16  # every benchmark that records figures


def _reference_step():
    spec = importlib.util.spec_from_file_location("reference_step", BENCH / "reference_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reference_step_prints_its_figure_and_writes_only_with_write(tmp_path, monkeypatch, capsys):
    bench = _reference_step()
    results = tmp_path / "reference_step_cpu.jsonl"
    monkeypatch.setattr(bench, "results_path", lambda name: results)  # never the committed file, here
    tiny = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.seq_len=16", "train.batch_size=2"]
    args = [str(REPO_ROOT / "experiments" / "gpt_tiny.yaml"), *tiny, "--steps", "1"]
    assert bench.main(args) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["bench"] == "reference_step" and not results.exists()
    assert bench.main([*args, "--write"]) == 0
    assert [json.loads(line)["bench"] for line in results.read_text().splitlines()] == ["reference_step"]
