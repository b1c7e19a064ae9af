"""Plans on paper for one 80 GB GPU: `angel-jax plan --estimate` for the large GPT configs at a global batch of
256 x 2048 tokens, under the budgets device 80e9 B, host 120e9 B and a disk tier, with the target machine's links
stated on each command line.

    python experiments/bench/paper_plans.py [--only NAME] [--no-save]

Nothing is measured here: every figure is the planner's prediction from FLOPs at the stated peak (989 TFLOP/s,
an H100/H200 SXM's dense bf16) and the stated bandwidths. Two sets of links are assumed:

  conservative   h2d/d2h 25 GB/s (a PCIe Gen4 x16 link), disk 3 GB/s read and write (one NVMe SSD), host memory
                 traffic 50 GB/s for the host optimizer and gradient sums (a fraction of a server socket's)
  gen5           h2d/d2h 50 GB/s (PCIe Gen5 x16, as on H100/H200 SXM servers), disk 6 GB/s read / 4 GB/s write
                 (one PCIe Gen4 NVMe SSD), host 100 GB/s

Per case (one JSON line each, appended to experiments/results/paper_plans_<platform>.jsonl unless --no-save; the
Gantt chart and plan.json under experiments/results/paper_plans/<case>/): the command line, the predicted step
time and MFU, the stream that bounds the step and each stream's busy share, the chosen micro-batch size, passes
and prefetch, the stages resident / streamed, each page family's bytes per tier, and the peak bytes per tier.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from angel_jax.benchinfo import emit, results_path

ROOT = Path(__file__).resolve().parents[2]
BUDGETS = ["memory.device_budget=80000000000", "memory.host_budget=120000000000", "train.batch_size=256"]
PEAK = ["--estimate", "--peak-tflops", "989"]
LINKS = {"conservative": ["--h2d-gbps", "25", "--disk-read-gbps", "3", "--disk-write-gbps", "3", "--host-gbps", "50"],
         "gen5": ["--h2d-gbps", "50", "--disk-read-gbps", "6", "--disk-write-gbps", "4", "--host-gbps", "100"]}
CASES = {
    # The starting point: 4 x 2048 tokens per step, fp32 state.
    "gpt_13b_batch4_gen5": ("experiments/gpt_13b.yaml", ["train.batch_size=4"], "gen5"),
    "gpt_13b_conservative": ("experiments/gpt_13b.yaml", [], "conservative"),
    "gpt_13b_lockfree_conservative": ("experiments/gpt_13b.yaml", ["memory.staleness=1"], "conservative"),
    "gpt_13b_gen5": ("experiments/gpt_13b.yaml", [], "gen5"),
    "gpt_13b_bf16_moments_conservative": ("experiments/gpt_13b.yaml", ["optimizer.state_dtype=bfloat16"],
                                          "conservative"),
    # 30 B: fp32 parameters and gradients alone (237 GB) exceed device + host, so with passes (gradients on the
    # host) parameters go to disk; with model.param_dtype=bfloat16 (parameters, gradients and Adam moments in
    # bf16: 8 B per parameter) the optimizer state lives on disk and parameters on the host.
    "gpt_30b_gen5": ("experiments/gpt_30b.yaml", [], "gen5"),
    "gpt_30b_bf16_params_conservative": ("experiments/gpt_30b.yaml", ["model.param_dtype=bfloat16"],
                                         "conservative"),
    "gpt_30b_bf16_params_gen5": ("experiments/gpt_30b.yaml", ["model.param_dtype=bfloat16"], "gen5"),
}


def run_case(name: str, config: str, overrides: list[str], links: str, disk_dir: str, out: Path) -> dict:
    args = [config, *BUDGETS, f"memory.disk_dir={disk_dir}", *overrides, *PEAK, *LINKS[links]]
    command = ["angel-jax", "plan", *args, "--out", "OUT"]
    done = subprocess.run([sys.executable, "-m", "angel_jax.cli", "plan", *args, "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True)
    if done.returncode:
        return {"bench": "paper_plans", "case": name, "command": " ".join(command), "links": links,
                "error": (done.stdout + done.stderr).strip().splitlines()[-1]}
    plan = json.loads((out / "plan.json").read_text())
    return {"bench": "paper_plans", "case": name, "command": " ".join(command).replace(disk_dir, "DIR"),
            "links": links, "predicted_step_s": round(plan["predicted_step_s"], 2),
            "predicted_mfu": round(plan["predicted_mfu"], 4), "bound": plan["bound"],
            "stream_shares": {k: round(v, 3) for k, v in plan["stream_shares"].items()},
            "compute_waits_s": {k: round(v, 2) for k, v in plan["compute_waits_s"].items()},
            "micro_batch_size": plan["micro_batch_size"], "micro_batches": plan["micro_batches"],
            "passes": plan["passes"], "prefetch": plan["prefetch"], "resident": plan["resident"],
            "streamed": plan["streamed"], "table": plan["table"], "peak_bytes": plan["peak_bytes"],
            "params": plan["param_count"]["total"], "source": plan["source"].replace(disk_dir, "DIR")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=None, help="run one case (default: all)")
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args()
    results = None if args.no_save else results_path("paper_plans")
    charts = ROOT / "experiments" / "results" / "paper_plans"
    with tempfile.TemporaryDirectory() as tmp:
        for name, (config, overrides, links) in CASES.items():
            if args.only and name != args.only:
                continue
            out = Path(tmp) / name
            record = run_case(name, config, overrides, links, str(Path(tmp) / "disk"), out)
            emit(record, results)
            if results is not None and "error" not in record:
                (charts / name).mkdir(parents=True, exist_ok=True)
                for f in ("timeline_predicted.png", "plan.json"):
                    shutil.copy(out / f, charts / name / f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
