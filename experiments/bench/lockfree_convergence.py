"""Updates one step behind against exact updates: the main job's loss over a whole run with every stage streamed.

    python experiments/bench/lockfree_convergence.py [--config experiments/gpt_tiny.yaml] [--steps 600]
        [--device-budget 36000000] [--page-size 262144] [--write] [key=value ...]

Trains the config twice with the paged engine, every stage streamed through host memory and updated there (a
device budget that holds no stage), in its own process each: `memory.staleness=0` (exact: step t+1 waits for each
stage's update of step t) and `memory.staleness=1` (lock-free: a stage may run step t+1 with its step t-1
parameters while its step-t update is written, Angel-PTM's lock-free update; the steps before
`memory.lock_free_from`, 100 by default, update exactly). Same seed, same data; key=value overrides
(optimizer.lr=1e-3, memory.lock_free_from=0, ...) apply to both runs and are recorded with every figure.

Figures (one JSON line each, appended to experiments/results/lockfree_convergence_<platform>.jsonl with --write):

  run_<staleness>        per run: the final training loss (mean of the last 50 steps' losses), the last eval/loss,
                         the mean step time after the first 20 steps, the plan (stages streamed, predicted step),
                         the lock-free run's first stale step (lock_free_from)
  loss_gap               (final loss with staleness 1 - with staleness 0) / with staleness 0; the target is |gap| <= 1%
  eval_gap               the same for the last eval/loss
  step_time_ratio        mean step time with staleness 1 / with staleness 0 (on this machine; a CPU's "device" and
                         host are the same cores, so this says little of a GPU's gain: the plan's prediction does)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from angel_jax.benchinfo import emit, machine_info, results_path

ROOT = Path(__file__).resolve().parents[2]
TAIL = 50  # steps whose mean loss is the run's final loss (one step's loss is one batch's: noisy)
WARMUP = 20  # steps left out of the mean step time (compilation, first prefetches)
RUN_LIMIT_S = 1800


def train(config: Path, staleness: int, steps: int, budget: int, page_size: int, run_dir: Path,
          extra: list[str]) -> dict:
    """One run in its own process (its memory capped by the engine's own plan refusal); its metrics and events."""
    overrides = [f"train.steps={steps}", f"train.run_dir={run_dir}", "train.progress=false", "train.log_every=1",
                 "memory.mode=paged",
                 f"memory.device_budget={budget}", f"memory.page_size={page_size}", f"memory.staleness={staleness}",
                 "checkpoint.every=0", *extra]
    cmd = ["timeout", "-s", "KILL", str(RUN_LIMIT_S), sys.executable, "-m", "angel_jax.cli", "train", str(config),
           *overrides]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"staleness {staleness}: exit {done.returncode}\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train_records = [r for r in records if "loss" in r]
    evals = [r["eval/loss"] for r in records if "eval/loss" in r]
    times = [r["perf/step_time"] for r in train_records[WARMUP:] if "perf/step_time" in r]
    plan = json.loads((run_dir / "plan.json").read_text())
    memory = yaml.safe_load((run_dir / "config.yaml").read_text())["memory"]  # (the run's resolved config)
    return {"staleness": staleness, "steps": len(train_records),
            "final_loss": statistics.fmean(r["loss"] for r in train_records[-TAIL:]),
            "first_loss": train_records[0]["loss"], "last_eval_loss": evals[-1] if evals else None,
            "step_time_s": statistics.fmean(times) if times else None,
            "lock_free_from": memory.get("lock_free_from") if staleness else None,
            "streamed": plan.get("streamed"), "predicted_step_s": plan.get("predicted_step_s"),
            "done_line": next((line for line in done.stdout.splitlines()[::-1] if line.startswith("done:")), "")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=ROOT / "experiments" / "gpt_tiny.yaml")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--device-budget", type=int, default=36_000_000, help="bytes; the default streams every stage "
                                                                          "of gpt_tiny")
    p.add_argument("--page-size", type=int, default=262_144)
    p.add_argument("--write", action="store_true", help="append the figures to experiments/results/")
    p.add_argument("overrides", nargs="*", help="key=value config overrides for both runs")
    args = p.parse_args(argv)
    results = results_path("lockfree_convergence") if args.write else None
    machine = machine_info()
    base = {"config": str(args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT) else args.config),
            "steps": args.steps, "device_budget": args.device_budget, "page_size": args.page_size,
            "overrides": args.overrides}
    runs = {}
    with tempfile.TemporaryDirectory(prefix="angel_jax_lockfree_") as work:
        for staleness in (0, 1):
            runs[staleness] = train(args.config, staleness, args.steps, args.device_budget, args.page_size,
                                    Path(work) / f"staleness{staleness}", args.overrides)
            emit({"figure": f"run_{staleness}", **base, **runs[staleness]}, results, machine)
    exact, stale = runs[0], runs[1]
    emit({"figure": "loss_gap", **base, "value": (stale["final_loss"] - exact["final_loss"]) / exact["final_loss"],
          "target_abs": 0.01}, results, machine)
    if exact["last_eval_loss"] and stale["last_eval_loss"]:
        emit({"figure": "eval_gap", **base,
              "value": (stale["last_eval_loss"] - exact["last_eval_loss"]) / exact["last_eval_loss"]}, results, machine)
    if exact["step_time_s"] and stale["step_time_s"]:
        emit({"figure": "step_time_ratio", **base, "value": stale["step_time_s"] / exact["step_time_s"]},
             results, machine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
