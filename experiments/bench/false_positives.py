"""False positives of the default anomaly thresholds on the main job: clean runs, default detectors and actions.

    python experiments/bench/false_positives.py [--config experiments/gpt_tiny.yaml] [--runs 300x0,300x1,1000x2]
                                                [--workdir DIR] [--write] [KEY=VALUE ...]

`--runs` lists STEPSxSEED: each entry is one real `angel-jax train` of the config with `train.steps=STEPS` and
`data.seed=SEED` (a different data order), `train.log_every=1` so every step's figures are in metrics.jsonl, and
nothing else changed: default thresholds, default actions. Every anomaly event (and every update the guard
dropped) in a clean run is a false positive.

Beside the count, each run says how close it came: the detectors of the spike figures (loss, gradient norm,
update norm) are replayed on the logged figures and `closest` is the largest value / threshold seen after
warm-up (1.0 fires). A run at 0.95 was one unlucky batch from a false alarm; one at 0.4 had a wide margin.

Output: one JSON line per run (appended to experiments/results/false_positives_<platform>.jsonl).
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from angel_jax.benchinfo import emit, results_path
from angel_jax.config import load_config
from angel_jax.tee.detectors import SpikeDetector
from angel_jax.tee.events import read_events
from angel_jax.train.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
SPIKES = {"loss_spike": "loss", "grad_spike": "grad_norm", "update_spike": "update_norm"}


def closest_approach(config_path: str, overrides: list[str], records: list[dict]) -> dict[str, float | None]:
    """Per spike detector: the largest value / firing threshold over the run (None if it never left warm-up)."""
    thresholds = load_config(config_path, overrides).anomaly.thresholds
    out: dict[str, float | None] = {}
    for name, metric in SPIKES.items():
        detector = SpikeDetector(name, metric, getattr(thresholds, name))
        state, worst = detector.init(), None
        for r in sorted(records, key=lambda r: r["step"]):
            value = r.get(metric)
            if value is None or not math.isfinite(value):
                continue
            bound = detector.bound(state)
            if math.isfinite(bound) and bound > 0:
                worst = max(worst or 0.0, value / bound)
            state, _ = detector.update(state, r["step"], value)
        out[name] = None if worst is None else round(worst, 3)
    return out


def one_run(config: str, steps: int, seed: int, work: Path, extra: list[str], limit: float) -> dict:
    run_dir = work / f"clean_{steps}x{seed}"
    overrides = [f"train.steps={steps}", f"data.seed={seed}", f"train.run_dir={run_dir}", "train.progress=false",
                 "train.log_every=1", f"checkpoint.memory_dir={run_dir}.memtier", *extra]
    t0 = time.monotonic()
    with open(work / f"clean_{steps}x{seed}.log", "w") as log:
        rc = subprocess.run(["timeout", "-s", "KILL", str(int(limit)), sys.executable, "-m", "angel_jax.cli",
                             "train", config, *overrides], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, JAX_PLATFORMS="cpu")).returncode
    records = list(read_jsonl(run_dir / "metrics.jsonl")) if (run_dir / "metrics.jsonl").exists() else []
    events = list(read_events(run_dir / "events.jsonl")) if (run_dir / "events.jsonl").exists() else []
    false = [e for e in events if e["kind"] in ("anomaly", "skipped")]
    return {"figure": "clean_run_false_positives", "config": config, "steps": steps, "data_seed": seed,
            "exit_status": rc, "final_step": max((r["step"] for r in records), default=0),
            "false_positives": len(false),
            "events": [f"{e.get('detector', e['kind'])}@{e.get('step')}" for e in false],
            "closest": closest_approach(config, overrides, records),
            "final_loss": round(records[-1]["loss"], 4) if records else None,
            "wall_s": round(time.monotonic() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="experiments/gpt_tiny.yaml")
    p.add_argument("--runs", default="300x0,300x1,300x2,300x3,300x4,1000x0,1000x1,1000x2",
                   help="comma-separated STEPSxSEED")
    p.add_argument("--limit", type=float, default=3600, help="seconds before a run is killed")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--write", action="store_true", help="append the figures to experiments/results/")
    p.add_argument("overrides", nargs="*", help="KEY=VALUE config overrides for every run")
    args = p.parse_args(argv)
    runs = [tuple(int(x) for x in spec.split("x")) for spec in args.runs.split(",") if spec]
    work = args.workdir or Path(tempfile.mkdtemp(prefix="angel-fp-"))
    work.mkdir(parents=True, exist_ok=True)
    out = results_path("false_positives") if args.write else None
    total = 0
    for steps, seed in runs:
        row = one_run(args.config, steps, seed, work, args.overrides, args.limit)
        total += row["false_positives"]
        emit({**row, "overrides": args.overrides}, out)
    print(f"{total} false positives in {len(runs)} clean runs ({sum(s for s, _ in runs)} steps); work dir {work}",
          file=sys.stderr)
    return 0 if total == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
