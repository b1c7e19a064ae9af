"""A target machine's calibration for `angel-jax plan --estimate --calibration FILE`, built from the measurements
one machine committed under experiments/results/ (nothing is measured here, and nothing is assumed: a figure with
no measurement behind it is an error naming the benchmark to run there).

    python experiments/bench/calibration.py [--device "NVIDIA H200"] [--write | --out FILE]

prints the calibration; --write writes it to experiments/results/h200_calibration.json (the committed file), --out to
FILE.

From the `*_gpu.jsonl` records whose machine is that device:

  compute_flops   FLOP/s a block's forward and backward reach there: the in-memory engine's measured MFU
                  (paged_gpu.py's `fits_auto` reference and its `rung` runs in memory) x the device's peak, x 4/3
                  for runs with rematerialised blocks (their backward recomputes the forward: 8N FLOPs per token
                  done where the MFU counts 6N), the median over the runs. The planner's stage times count the
                  same 4 forward passes per step (forward, then recompute + 2 in the backward), so a plan's compute
                  takes what those runs took
  peak_flops      the device's dense bf16 peak (train/metrics.py's table): what a plan's MFU is stated against
  bandwidth_Bps   h2d_pinned, d2h_pinned, device_copy (bench io), disk_read / disk_write (bench io's disk tier),
                  host_update (host_optimizer.py's `update`: the bytes a stage's host update moves per second)
  device_memory_bytes  the device's memory (probe_device's memory statistics), the device budget of a plan
                  whose config sets none

Each figure names the file, record and date it came from (`sources`); `machines` gives, per file, the machine,
versions and date of the record used.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any, Iterator

from angel_jax.train.metrics import PEAK_FLOPS

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "experiments" / "results"
DEFAULT_OUT = "h200_calibration.json"


def records(name: str, device: str) -> Iterator[dict[str, Any]]:
    path = RESULTS / name
    if not path.is_file():
        return
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            if device in str(r.get("machine", {}).get("device", "")):
                yield r


def _where(name: str, r: dict) -> str:
    return f"{name} {r.get('figure') or r.get('what')} ({str(r.get('machine', {}).get('date', '?'))[:10]})"


def _machines(used: dict[str, dict]) -> dict[str, dict]:
    """Per source file, the machine its record was measured on: device, host CPU, versions, date."""
    return {name: {k: r.get("machine", {}).get(k) for k in ("device", "cpu", "cpu_count", "versions", "date")}
            for name, r in used.items()}


def peak_flops(device: str) -> float:
    keys = [k for k in PEAK_FLOPS if k in device]
    if not keys:
        raise SystemExit(f"{device!r} is not in train/metrics.py's peak table: add its datasheet peak there")
    return float(PEAK_FLOPS[max(keys, key=len)])


def build(device: str) -> dict[str, Any]:
    peak = peak_flops(device)
    sources: dict[str, str] = {}
    used: dict[str, dict] = {}
    mfus = []
    for r in records("paged_gpu_gpu.jsonl", device):
        if r.get("figure") == "fits_auto" and r.get("reference_mfu"):
            mfus.append((r["reference_mfu"], _where("paged_gpu_gpu.jsonl", r) + ": the in-memory reference"))
            used["paged_gpu_gpu.jsonl"] = r
    for r in records("paged_gpu_rungs_gpu.jsonl", device):
        if r.get("figure") == "rung" and r.get("engine") == "in_memory" and r.get("ok") and r.get("mfu"):
            mfus.append((r["mfu"], _where("paged_gpu_rungs_gpu.jsonl", r) + f": {r['layers']} layers in memory"))
            used["paged_gpu_rungs_gpu.jsonl"] = r
    if not mfus:
        raise SystemExit(f"no in-memory MFU measured on {device}: run experiments/bench/paged_gpu.py there")
    remat = 4 / 3  # paged_gpu.py builds its rungs on gpt_1b.yaml (model.remat: true)
    mfu = statistics.median(m for m, _ in mfus)
    compute = mfu * peak * remat
    io = {r["figure"]: r for r in records("io_gpu.jsonl", device)}
    need = {"h2d_pinned": "h2d_pinned", "d2h_pinned": "d2h_pinned", "device_copy": "device_copy",
            "disk_read": "disk_tier_read", "disk_write": "disk_tier_write"}
    missing = [figure for figure in need.values() if figure not in io]
    if missing:
        raise SystemExit(f"bench io on {device} did not measure {missing}: run `angel-jax bench io` there")
    bandwidth = {key: io[figure]["GBps"] * 1e9 for key, figure in need.items()}
    for key, figure in need.items():
        sources[key] = _where("io_gpu.jsonl", io[figure])
    used["io_gpu.jsonl"] = io["h2d_pinned"]
    updates = [r for r in records("host_optimizer_gpu.jsonl", device) if r.get("figure") == "update"]
    if not updates:
        raise SystemExit(f"no host update measured on {device}: run experiments/bench/host_optimizer.py there")
    latest = max(updates, key=lambda r: r.get("machine", {}).get("date", ""))
    used["host_optimizer_gpu.jsonl"] = latest
    bandwidth["host_update"] = latest["bytes_moved"] / latest["update_s_median"]
    how = "the fused host kernel" if latest.get("update_by") == "host kernel" else \
        "XLA's CPU update (no fused-kernel figure there yet)"
    sources["host_update"] = (_where("host_optimizer_gpu.jsonl", latest)
                              + f": {latest['optimizer']} on {latest['cores']} cores by {how}, bytes moved / median "
                                "update")
    out: dict[str, Any] = {
        "device": device, "peak_flops": peak, "compute_flops": compute,
        "compute_from": f"median in-memory MFU {mfu:.4f} of {len(mfus)} runs x {peak / 1e12:g} TFLOP/s x 4/3 "
                        "(rematerialised blocks)",
        "bandwidth_Bps": bandwidth,
    }
    for r in records("probe_device_gpu.jsonl", device):
        stats = r.get("stats") if r.get("what") == "device" else None
        if isinstance(stats, dict) and stats.get("bytes_limit"):
            out["device_memory_bytes"] = int(stats["bytes_limit"])
            sources["device_memory_bytes"] = _where("probe_device_gpu.jsonl", r) + ": memory_stats bytes_limit"
            used["probe_device_gpu.jsonl"] = r
    sources["compute_flops"] = "; ".join(w for _, w in mfus)
    out["sources"] = sources
    out["machines"] = _machines(used)
    out["built_by"] = "experiments/bench/calibration.py"
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="NVIDIA H200", help="the device whose committed measurements to use")
    p.add_argument("--write", action="store_true", help=f"write it to {(RESULTS / DEFAULT_OUT).relative_to(ROOT)}")
    p.add_argument("--out", type=Path, help="write it to this file")
    args = p.parse_args(argv)
    calibration = build(args.device)
    out = args.out or (RESULTS / DEFAULT_OUT if args.write else None)
    text = json.dumps(calibration, indent=2) + "\n"
    if out is None:  # the committed file is written only when asked
        print(text, end="")
    else:
        out.write_text(text)
    print(json.dumps({"bench": "calibration", "device": args.device, "out": str(out) if out else None,
                      "compute_tflops": round(calibration["compute_flops"] / 1e12, 1),
                      "links_GBps": {k: round(v / 1e9, 2) for k, v in calibration["bandwidth_Bps"].items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
