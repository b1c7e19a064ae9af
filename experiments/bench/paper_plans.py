"""Plans on paper: `angel-jax plan --estimate` for the large GPT configs, with the target machine's links stated
on each command line.

- One 80 GB GPU: gpt_13b and gpt_30b at a global batch of 256 x 2048 tokens, under the budgets device 80e9 B,
  host 120e9 B and a disk tier.
- Eight 80 GB GPUs, data parallel (ZeRO-3 pages: every page family partitioned over the 8 ranks; the plan, its
  bytes per tier and its budgets are one rank's): GPT-3 175B (experiments/gpt3_175b.yaml: fp32 master parameters,
  gradients and Adam moments, bf16 compute) at the paper's global batch of 1536 x 2048 tokens, each rank with
  device 80e9 B, host 1e12 B and a disk tier of its own; and gpt_13b at the same 256 x 2048 tokens and
  budgets as on one GPU, to show every rank's bytes shrink by 8; and a T5-MoE of 1.17 T parameters
  (experiments/t5_moe_1t.yaml) on 64 and on 128 such GPUs, InfiniBand, global batch 1024 x 568 tokens, with
  expert parallelism: each rank holds 384 / N whole experts of every MoE layer (never gathered; tokens reach them
  through all-to-alls, timed inside the stage calls) and 1/N of everything else (ZeRO-3). AdamW in place of the
  config's Adafactor: sharded pages need an elementwise optimizer. Collective links: NVLink, 150 GB/s
  per GPU each way (8 GPUs in one server; an H100/H200 SXM's NVLink 4 is 450 GB/s each way, of which a ring
  all-gather reaches a part), or InfiniBand, 25 GB/s per GPU (one 200 Gb/s HDR port per GPU, 8 servers).
- 8 x H200 servers, on one H200's measured figures (`H200_BOXES`): Llama-2 70B (experiments/llama_70b.yaml, fp32
  state, 256 x 4096 tokens per step) on one server of 8, and GPT-3 175B (1536 x 2048) on 8 servers = 64 GPUs.
  Each server: 2 TB of host memory (250 GB per rank: its share), 8 NVMe drives of 3.5 TB (one per rank); each
  rank's device budget the calibration's (the memory jax gives a process on one H200). Collectives: NVLink
  inside a server at 450 GB/s per rank (the H200's 900 GB/s is both directions together; a ring receives from
  one direction, so 450 is its ceiling: assumed, not measured, and a real ring reaches less), 400 Gb/s = 50 GB/s
  per GPU between servers (assumed), timed as the two-level algorithm (`--devices-per-node 8
  --inter-node-gbps 50`, angel_jax/schedule/links.py). Two more cases show how far the bound is from the
  links: 70B at 150 GB/s inside the server, and 175B with every link at 50 GB/s (a flat ring waiting for its
  slowest hop at every step).

    python experiments/bench/paper_plans.py [--only NAME] [--write]

Nothing is measured here: every figure is the planner's prediction from FLOPs at the stated peak (989 TFLOP/s,
an H100/H200 SXM's dense bf16) and the stated bandwidths. Two sets of links are assumed, and one is measured:

  conservative   h2d/d2h 25 GB/s (a PCIe Gen4 x16 link), disk 3 GB/s read and write (one NVMe SSD), host memory
                 traffic 50 GB/s for the host optimizer and gradient sums (a fraction of a server socket's)
  gen5           h2d/d2h 50 GB/s (PCIe Gen5 x16, as on H100/H200 SXM servers), disk 6 GB/s read / 4 GB/s write
                 (one PCIe Gen4 NVMe SSD), host 100 GB/s
  h200_measured  experiments/results/h200_calibration.json: one H200 machine's figures (compute at the rate the
                 in-memory engine reached there, ~420 TFLOP/s of the 989; pinned links ~49 GB/s; disk tier 1.4 read
                 / 1.8 write GB/s; host update 5.1 GB/s), under that machine's budgets (`H200_CASES`)

Per case (one JSON line each, appended to experiments/results/paper_plans_<platform>.jsonl with --write; the
Gantt chart, plan.json and the command line (command.txt) under experiments/results/paper_plans/<case>/): the
command line, the predicted step time and MFU, the stream that bounds the step and each stream's busy share, the
chosen micro-batch size, passes and prefetch, the stages resident / streamed, each page family's bytes per tier,
and the peak bytes per tier; with several devices, those of one rank, and the collectives' bytes and seconds per
step.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from angel_jax.benchinfo import emit, results_path

ROOT = Path(__file__).resolve().parents[2]
BUDGETS = ["memory.device_budget=80000000000", "memory.host_budget=120000000000", "train.batch_size=256"]
RANK_1TB = ["memory.device_budget=80000000000", "memory.host_budget=1000000000000"]
"""Each rank's budgets in the GPT-3 setting (its batch is the config's: 1536)."""
PEAK = ["--estimate", "--peak-tflops", "989"]
LINKS = {"conservative": ["--h2d-gbps", "25", "--disk-read-gbps", "3", "--disk-write-gbps", "3", "--host-gbps", "50"],
         "gen5": ["--h2d-gbps", "50", "--disk-read-gbps", "6", "--disk-write-gbps", "4", "--host-gbps", "100"],
         # One H200 machine's measured figures (experiments/bench/calibration.py): compute at the rate the in-memory
         # engine reached there, its links, disk tier and host update speed.
         "h200_measured": ["--calibration", "experiments/results/h200_calibration.json"]}
H200_BUDGETS = ["memory.device_budget=141000000000", "memory.host_budget=118111600640",
                "memory.disk_budget=64424509440"]
"""One H200 machine as measured: 141 GB of HBM, 110 GiB of host memory for the host tier, 60 GiB of disk."""
MASTER_LAYOUT = ["model.param_dtype=bfloat16", "optimizer.master_weights=true"]
OFFLOAD_LAYOUT = [*MASTER_LAYOUT, "memory.staleness=1"]
HOST_UPDATES = ["memory.streamed_updates=host", "memory.activations=device"]
H200_CASES = {
    # The throughput issue's two figures on paper: gpt_13b at 64 x 2048 tokens per step, and gpt_1b with a quarter
    # of its training state's bytes (19.4 GB: 1.21 B parameters x 16 B) on the device at 32 x 2048.
    "gpt_13b_h200_measured_64x2048": ("experiments/gpt_13b.yaml", ["train.batch_size=64"], H200_BUDGETS),
    "gpt_1b_h200_measured_state4_32x2048": ("experiments/gpt_1b.yaml", ["train.batch_size=32"],
                                            ["memory.device_budget=4850000000", *H200_BUDGETS[1:]]),
    # The same two with ZeRO-Offload's layout: bfloat16 parameters (what crosses the link, both ways) over a
    # float32 master kept with the Adam moments, and host updates one step behind (memory.staleness=1).
    "gpt_13b_h200_measured_64x2048_lockfree_bf16": ("experiments/gpt_13b.yaml", ["train.batch_size=64",
                                                                                 *OFFLOAD_LAYOUT], H200_BUDGETS),
    "gpt_1b_h200_measured_state4_32x2048_lockfree_bf16": (
        "experiments/gpt_1b.yaml", ["train.batch_size=32", *OFFLOAD_LAYOUT],
        ["memory.device_budget=4850000000", *H200_BUDGETS[1:]]),
    # ... and with the Adam moments stored in bfloat16 too (optimizer.state_dtype): fewer bytes through the host
    # update, which bounds both steps above.
    "gpt_13b_h200_measured_64x2048_lockfree_bf16_moments": (
        "experiments/gpt_13b.yaml", ["train.batch_size=64", *OFFLOAD_LAYOUT, "optimizer.state_dtype=bfloat16"],
        H200_BUDGETS),
    "gpt_1b_h200_measured_state4_32x2048_lockfree_bf16_moments": (
        "experiments/gpt_1b.yaml", ["train.batch_size=32", *OFFLOAD_LAYOUT, "optimizer.state_dtype=bfloat16"],
        ["memory.device_budget=4850000000", *H200_BUDGETS[1:]]),
    # The cases above plan with memory.streamed_updates=auto and memory.activations=auto (the defaults: streamed
    # stages update on the device, their state crossing the link, and stage inputs wait in host memory, where that
    # is predicted faster); these keep the updates on the host and the stage inputs on the device, as every plan
    # did before the two choices existed ...
    "gpt_13b_h200_measured_64x2048_host_updates": (
        "experiments/gpt_13b.yaml", ["train.batch_size=64", *HOST_UPDATES], H200_BUDGETS),
    "gpt_1b_h200_measured_state4_32x2048_host_updates": (
        "experiments/gpt_1b.yaml", ["train.batch_size=32", *HOST_UPDATES],
        ["memory.device_budget=4850000000", *H200_BUDGETS[1:]]),
    # The criterion's reference: gpt_1b with the whole H200 for its state, every stage resident (the paged engine's
    # plan of a model that fits: the in-memory engine's step, at the calibration's compute rate).
    "gpt_1b_h200_measured_all_resident_32x2048": ("experiments/gpt_1b.yaml", ["train.batch_size=32"], H200_BUDGETS),
    # ... and this one is exact (staleness 0) with bfloat16 parameters over a float32 master.
    "gpt_13b_h200_measured_64x2048_bf16_master": (
        "experiments/gpt_13b.yaml", ["train.batch_size=64", *MASTER_LAYOUT], H200_BUDGETS),
}
COLLECTIVES = {"nvlink": ["--link-gbps", "150"], "infiniband": ["--link-gbps", "25"],
               "h200_nvlink": ["--link-gbps", "450", "--devices-per-node", "8"],
               "h200_nvlink150": ["--link-gbps", "150", "--devices-per-node", "8"],
               "h200_nvlink_ib400": ["--link-gbps", "450", "--devices-per-node", "8", "--inter-node-gbps", "50"],
               "h200_all50": ["--link-gbps", "50", "--devices-per-node", "8", "--inter-node-gbps", "50"]}
H200_BOX_RANK = ("memory.host_budget=250000000000", "memory.disk_budget=3500000000000")
"""Each rank's budgets on an 8 x H200 server: its share of 2 TB of host memory and one 3.5 TB NVMe drive (the
device budget is the calibration's)."""
H200_BOX_ASSUMED = ("server: 8 x H200, 2 TB host memory (250 GB per rank), 8 x 3.5 TB NVMe (one per rank): "
                    "assumed; disk figures are the calibration's (one H200 machine's disk tier), not an NVMe's",
                    "host update: the calibration's 5.1 GB/s (XLA's update on that machine's 16 cores) per rank, "
                    "assuming each of a server's 8 ranks has as many cores")
"""What the 8 x H200 cases assume besides their link flags (each recorded with the case)."""


@dataclass(frozen=True)
class MultiDevice:
    """A data-parallel case: its config, overrides, links, budgets, devices and collective link."""

    config: str
    overrides: tuple[str, ...]
    links: str
    budgets: tuple[str, ...]
    devices: int
    collectives: str
    assumed: tuple[str, ...] = ()
    """What the case assumes that nothing measured: recorded with its figures."""


MULTI = {
    "gpt3_175b_8x80g_nvlink": MultiDevice("experiments/gpt3_175b.yaml", (), "conservative", tuple(RANK_1TB), 8,
                                          "nvlink"),
    "gpt3_175b_8x80g_infiniband": MultiDevice("experiments/gpt3_175b.yaml", (), "conservative", tuple(RANK_1TB), 8,
                                              "infiniband"),
    # The T5-MoE of 1.17 T parameters (experiments/t5_moe_1t.yaml) on 64 GPUs (8 servers of 8, InfiniBand
    # between them) and on 128 (16 servers), each rank with device 80e9 B, host 1e12 B and a disk tier, 6 or 3
    # experts of each MoE layer its own: the fp32 parameters, gradients and AdamW moments are 18.7 TB in all.
    "t5_moe_1t_64x80g_infiniband": MultiDevice("experiments/t5_moe_1t.yaml", ("optimizer.name=adamw",),
                                               "conservative", tuple(RANK_1TB), 64, "infiniband"),
    "t5_moe_1t_128x80g_infiniband": MultiDevice("experiments/t5_moe_1t.yaml", ("optimizer.name=adamw",),
                                                "conservative", tuple(RANK_1TB), 128, "infiniband"),
    # gpt_13b_conservative (below) on 8 GPUs: the same global batch, links and budgets per GPU.
    "gpt_13b_8x80g_nvlink_conservative": MultiDevice("experiments/gpt_13b.yaml", (), "conservative", tuple(BUDGETS),
                                                     8, "nvlink"),
}
NVLINK_450 = "link 450 GB/s per rank inside a server: the H200's NVLink 900 GB/s counts both directions; a ring " \
             "receives at one direction's 450 at most (assumed, not measured)"
IB_400 = "inter-node 50 GB/s per rank: one 400 Gb/s port per GPU, rail-aligned (assumed, not measured)"
H200_BOXES = {
    "llama_70b_8xh200_nvlink": MultiDevice("experiments/llama_70b.yaml", (), "h200_measured", H200_BOX_RANK, 8,
                                           "h200_nvlink", (NVLINK_450, *H200_BOX_ASSUMED)),
    "llama_70b_8xh200_nvlink150": MultiDevice(
        "experiments/llama_70b.yaml", (), "h200_measured", H200_BOX_RANK, 8, "h200_nvlink150",
        ("link 150 GB/s per rank inside a server: a third of NVLink's one-way ceiling (assumed)", *H200_BOX_ASSUMED)),
    "gpt3_175b_64xh200_nvlink_ib400": MultiDevice("experiments/gpt3_175b.yaml", (), "h200_measured", H200_BOX_RANK,
                                                  64, "h200_nvlink_ib400", (NVLINK_450, IB_400, *H200_BOX_ASSUMED)),
    "gpt3_175b_64xh200_all50": MultiDevice(
        "experiments/gpt3_175b.yaml", (), "h200_measured", H200_BOX_RANK, 64, "h200_all50",
        ("every link 50 GB/s per rank, inside the server too: a flat ring's slowest hop (assumed)", IB_400,
         *H200_BOX_ASSUMED)),
}
MASTER = ["model.param_dtype=bfloat16", "optimizer.master_weights=true"]
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
    # Mixed precision as large runs train: bf16 parameters and gradients to compute with and stream, and in the
    # optimizer state (on disk) a float32 master copy and Adam's moments, float32 (12 B per parameter) or bf16 (8 B).
    "gpt_30b_fp32_master_conservative": ("experiments/gpt_30b.yaml", MASTER, "conservative"),
    "gpt_30b_fp32_master_gen5": ("experiments/gpt_30b.yaml", MASTER, "gen5"),
    "gpt_30b_fp32_master_bf16_moments_conservative": ("experiments/gpt_30b.yaml",
                                                      MASTER + ["optimizer.state_dtype=bfloat16"], "conservative"),
    "gpt_30b_fp32_master_bf16_moments_gen5": ("experiments/gpt_30b.yaml", MASTER + ["optimizer.state_dtype=bfloat16"],
                                              "gen5"),
}


def run_case(name: str, config: str, overrides: list[str], links: str, disk_dir: str, out: Path,
             budgets: list[str] = BUDGETS, target: list[str] = (), assumed: tuple[str, ...] = ()) -> dict:
    args = [config, *budgets, f"memory.disk_dir={disk_dir}", *overrides, *PEAK, *LINKS[links], *target]
    command = ["angel-jax", "plan", *args, "--out", "OUT"]
    done = subprocess.run([sys.executable, "-m", "angel_jax.cli", "plan", *args, "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True)
    if done.returncode:
        return {"bench": "paper_plans", "case": name, "command": " ".join(command).replace(disk_dir, "DIR"),
                "links": links,
                "error": (done.stdout + done.stderr).strip().splitlines()[-1]}
    plan = json.loads((out / "plan.json").read_text())
    (out / "command.txt").write_text(" ".join(command).replace(disk_dir, "DIR") + "\n")
    ranks = {}
    if plan.get("ranks", 1) > 1:
        io = plan["io_per_step"]
        ranks = {"devices": plan["ranks"], "per_rank": True, "gather_bytes": plan["gather_bytes"],
                 "collective_bytes_per_rank": io["collective_bytes"], "collective_s": round(io["collective_s"], 2),
                 "peak_bytes_all_ranks": {k: plan["ranks"] * v for k, v in plan["peak_bytes"].items()},
                 **({"per_host": plan["per_host"]} if "per_host" in plan else {})}
    return {"bench": "paper_plans", "case": name, "command": " ".join(command).replace(disk_dir, "DIR"),
            "links": links, **({"assumed": list(assumed)} if assumed else {}), **ranks, "predicted_step_s": round(plan["predicted_step_s"], 2),
            "predicted_mfu": round(plan["predicted_mfu"], 4), "bound": plan["bound"],
            "stream_shares": {k: round(v, 3) for k, v in plan["stream_shares"].items()},
            "compute_waits_s": {k: round(v, 2) for k, v in plan["compute_waits_s"].items()},
            "micro_batch_size": plan["micro_batch_size"], "micro_batches": plan["micro_batches"],
            "passes": plan["passes"], "prefetch": plan["prefetch"], "resident": plan["resident"],
            "streamed": plan["streamed"], "streamed_device_updates": plan.get("streamed_device_updates", 0),
            "activations_parked_bytes": plan.get("activations_parked_bytes", 0), "table": plan["table"], "peak_bytes": plan["peak_bytes"],
            "params": plan["param_count"]["total"], "source": plan["source"].replace(disk_dir, "DIR")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=None, help="run the cases whose name starts with this (default: all)")
    p.add_argument("--write", action="store_true", help="append the figures to experiments/results/")
    args = p.parse_args()
    results = results_path("paper_plans") if args.write else None
    charts = ROOT / "experiments" / "results" / "paper_plans"
    cases = {name: (config, overrides, links, BUDGETS, [], ()) for name, (config, overrides, links) in CASES.items()}
    cases.update({name: (c.config, list(c.overrides), c.links, list(c.budgets),
                         ["--devices", str(c.devices), *COLLECTIVES[c.collectives]], c.assumed)
                  for name, c in {**MULTI, **H200_BOXES}.items()})
    cases.update({name: (config, overrides, "h200_measured", budgets, [], ())
                  for name, (config, overrides, budgets) in H200_CASES.items()})
    with tempfile.TemporaryDirectory() as tmp:
        for name, (config, overrides, links, budgets, target, assumed) in cases.items():
            if args.only and not name.startswith(args.only):
                continue
            out = Path(tmp) / name
            record = run_case(name, config, overrides, links, str(Path(tmp) / "disk"), out, budgets, target,
                              assumed)
            emit(record, results)
            if results is not None and "error" not in record:
                (charts / name).mkdir(parents=True, exist_ok=True)
                for f in ("timeline_predicted.png", "plan.json", "command.txt"):
                    shutil.copy(out / f, charts / name / f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
