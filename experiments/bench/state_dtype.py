"""What storing the optimizer state in bfloat16 costs in loss, and what it saves in bytes, on the main job.

    python experiments/bench/state_dtype.py [--config experiments/gpt_tiny.yaml] [--steps 300] [--write]

Two real `angel-jax train` runs of the config, identical but for `optimizer.state_dtype` (float32, then
bfloat16), each in its own process. Figures (one JSON line each, appended to
experiments/results/state_dtype_<platform>.jsonl with --write):

  loss_effect     final loss and the mean loss of the last 50 steps of each run, and their relative difference
                  (goal: within 1% of float32)
  state_bytes     optimizer-state bytes per parameter in each run (read from a checkpoint of the run's state)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from angel_jax.benchinfo import emit, results_path
from angel_jax.train.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[2]


def run(config: str, steps: int, dtype: str, workdir: Path) -> dict:
    run_dir = workdir / dtype
    cmd = [sys.executable, "-m", "angel_jax.cli", "train", config, f"train.steps={steps}", "train.log_every=1",
           f"train.run_dir={run_dir}", f"optimizer.state_dtype={dtype}", "checkpoint.every=0",
           f"checkpoint.memory_dir={workdir / (dtype + '.memtier')}"]
    done = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    losses = [r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
    index = json.loads(next((workdir / (dtype + ".memtier")).rglob("index.json")).read_text())
    return {"losses": losses, "index": index}


def optimizer_bytes_per_param(index: dict) -> float:
    arrays = index["arrays"] if isinstance(index.get("arrays"), dict) else {a["name"]: a for a in index["arrays"]}
    def nbytes(a: dict) -> int:
        return int(np.prod(a["shape"])) * np.dtype(a["dtype"]).itemsize
    params = sum(int(np.prod(a["shape"])) for n, a in arrays.items() if n.startswith("params/"))
    opt = sum(nbytes(a) for n, a in arrays.items() if n.startswith("opt_state/"))
    return opt / params


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "experiments" / "gpt_tiny.yaml"))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--write", action="store_true", help="append the figures to experiments/results/")
    args = p.parse_args()
    out = results_path("state_dtype") if args.write else None
    with tempfile.TemporaryDirectory(prefix="state_dtype.") as d:
        runs = {dtype: run(args.config, args.steps, dtype, Path(d)) for dtype in ("float32", "bfloat16")}
    final = {k: r["losses"][-1] for k, r in runs.items()}
    tail = {k: float(np.mean(r["losses"][-50:])) for k, r in runs.items()}
    emit({"bench": "state_dtype", "figure": "loss_effect", "config": Path(args.config).stem, "steps": args.steps,
          "final_loss": final, "last50_mean_loss": tail,
          "final_rel_diff": round(final["bfloat16"] / final["float32"] - 1, 5),
          "last50_rel_diff": round(tail["bfloat16"] / tail["float32"] - 1, 5), "goal": 0.01,
          "meets_goal": abs(tail["bfloat16"] / tail["float32"] - 1) <= 0.01}, out)
    emit({"bench": "state_dtype", "figure": "state_bytes", "config": Path(args.config).stem,
          "optimizer_bytes_per_param": {k: round(optimizer_bytes_per_param(r["index"]), 3)
                                        for k, r in runs.items()}}, out)


if __name__ == "__main__":
    main()
