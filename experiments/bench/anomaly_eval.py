"""Anomaly detection, evaluated: inject faults into real training runs and check what the detectors did.

    python experiments/bench/anomaly_eval.py [--config experiments/gpt_tiny.yaml] [--steps 400] [--clean-steps 1000]
                                             [--cases nan_batch,corrupt_batch,...] [--workdir DIR] [--write]

Every case is a real `angel-jax train` (single process) or `angel-jax launch -n 2` (two workers) process with a
fault injected through ANGEL_JAX_FAULTS (angel_jax/tol/faults.py), default thresholds and actions. For each
case the table says whether the fault was detected (an anomaly event of the expected detector in events.jsonl),
how many steps after the injection, what was done about it, and whether the run still finished all its steps with
a healthy loss (the mean loss of its last 20 steps within 5% of the clean run's over the same steps). Clean runs of --clean-steps steps count false
positives: any anomaly event at all.

Single-process cases:  nan_batch, corrupt_batch, lr_blowup, leak (memory growth -> restart: the harness restarts
                       the run the way the watchdog would, ANGEL_JAX_ATTEMPT=1, and the leak is gone)
Two-worker cases:      slow (one worker 3x slower: a straggler, logged by default), slow_exclude (the same with
                       `anomaly.actions.straggler=exclude` and one spare node: the slow node is replaced),
                       hang (one worker stops making progress)

Output: one JSON line per case (appended to experiments/results/anomaly_eval_<platform>.jsonl) and a markdown
table written to experiments/results/anomaly_eval_<platform>.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from angel_jax.benchinfo import emit, machine_info, results_path
from angel_jax.tee.events import read_events
from angel_jax.train.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Case:
    name: str
    fault: str
    """ANGEL_JAX_FAULTS spec; {at} is the injection step, {batch} its global batch index, {early} = at // 3."""
    detectors: tuple[str, ...]
    """Any of these detectors counts as detecting it."""
    workers: int = 1
    overrides: tuple[str, ...] = ()
    spares: int = 0
    """Spare nodes given to `angel-jax launch --spares` (two-worker cases)."""


def cases(at: int) -> dict[str, Case]:
    return {c.name: c for c in (
        Case("nan_batch", "nan_batch@{batch}", ("nan",)),
        Case("corrupt_batch", "corrupt_batch@{batch}", ("loss_spike", "grad_spike")),
        Case("lr_blowup", "lr_blowup@{at}:steps=3:scale=100", ("update_spike", "grad_spike", "loss_spike")),
        # A leak shows only over a whole window (200 steps after a 100-step warm-up): it starts early.
        Case("leak", "leak@{early}:mib=8:attempt=0", ("memory_growth",)),
        Case("slow", "slow@{at}:factor=3:rank=1", ("straggler",), workers=2),
        # The slowness belongs to the node: the attempt on the spare node (attempt 1) runs at full speed.
        Case("slow_exclude", "slow@{at}:factor=3:rank=1:attempt=0", ("straggler",), workers=2, spares=1,
             overrides=("anomaly.actions.straggler=exclude",)),
        # The hang is cured by the restart (attempt 0 only), as a transient hang would be.
        Case("hang", "hang@{at}:rank=1:attempt=0", ("hang",), workers=2,
             overrides=("resilience.hang_timeout_min=20",)),
    )}


def run(cmd: list[str], env: dict[str, str], log: Path, limit: float) -> int:
    with open(log, "a") as out:
        proc = subprocess.Popen(["timeout", "-s", "KILL", str(int(limit)), *cmd], env=env, stdout=out,
                                stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        return proc.wait()


def train_cmd(case: Case, config: str, run_dir: Path, steps: int) -> list[str]:
    common = [config, f"train.steps={steps}", f"train.run_dir={run_dir}", "train.progress=false",
              "train.log_every=1", f"checkpoint.memory_dir={run_dir}.memtier", *case.overrides]
    if case.workers == 1:
        return [sys.executable, "-m", "angel_jax.cli", "train", *common]
    return [sys.executable, "-m", "angel_jax.cli", "launch", "-n", str(case.workers), "--spares", str(case.spares),
            *common]


def describe_actions(found: list[dict], events: list[dict], restarted_by_harness: bool = False) -> str | None:
    """What was done about the fault, in words, each thing once, in the order it happened."""
    said: list[str] = []

    def say(text: str) -> None:
        if text not in said:
            said.append(text)

    skipped = sum(1 for e in found if e.get("taken") == "skipped")
    for e in sorted(events, key=lambda e: e["time"]):
        kind = e["kind"]
        if e in found and e.get("taken") == "skipped":
            say(f"update dropped on the device ({skipped} step{'s' if skipped > 1 else ''})")
        elif e in found and str(e.get("taken")).startswith("logged"):
            say(e["taken"])
        elif e in found and e.get("taken") in ("restart", "exclude"):
            say(f"{e['taken']} requested (exit {75 if e['taken'] == 'restart' else 76})")
            if restarted_by_harness:
                say("restarted by the harness, as the watchdog would")
        elif kind == "rollback":
            first, last = e.get("skipped_batches", [None, None])
            say(f"rollback to step {e['to_step']} ({e.get('tier')} tier), batches {first}-{last} skipped")
        elif kind == "exclusion":
            say(f"node {e['node']} excluded, rank {e['rank']} moved to {e['replaced_by']}")
        elif kind == "restart":
            say("restart")
        elif kind == "resumed":
            say(f"resumed at step {e['step']}")
    return "; ".join(said) or None


def evaluate(case: Case, config: str, work: Path, steps: int, at: int, clean: dict[int, float],
             limit: float) -> dict:
    run_dir = work / case.name
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               ANGEL_JAX_FAULTS=case.fault.format(at=at, batch=at - 1, early=at // 3))
    log = work / f"{case.name}.log"
    t0 = time.monotonic()
    injected = at // 3 if "{early}" in case.fault else at
    rc = run(train_cmd(case, config, run_dir, steps), env, log, limit)
    restarts = 0
    if case.workers == 1 and rc == 75:  # a restart request: restart the way the watchdog would
        restarts += 1
        rc = run(train_cmd(case, config, run_dir, steps), dict(env, ANGEL_JAX_ATTEMPT="1"), log, limit)
    events = list(read_events(run_dir / "events.jsonl"))
    # Detectors report `anomaly` events; the watchdog reports a hang as its own `hang` event.
    found = [e for e in events if (e["kind"] == "anomaly" and e.get("detector") in case.detectors)
             or e["kind"] in case.detectors]
    for e in found:
        e.setdefault("detector", e["kind"])
    first = min(found, key=lambda e: e["time"]) if found else None
    records = {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl")} \
        if (run_dir / "metrics.jsonl").exists() else {}
    last = max(records) if records else 0
    final, reference = _tail_mean(records, steps), _tail_mean(clean, steps)
    healthy = rc == 0 and last == steps and math.isfinite(final) and final <= 1.05 * reference
    return {"case": case.name, "fault": env["ANGEL_JAX_FAULTS"], "workers": case.workers,
            "detected": first is not None, "detector": first["detector"] if first else None,
            "steps_to_detection": (first["step"] - injected) if first and "step" in first else None,
            "seconds_without_progress": first.get("silent_s") if first else None,
            "action": describe_actions(found, events, restarts > 0), "restarts_by_harness": restarts,
            "exit_status": rc, "final_step": last, "final_loss": round(final, 4),
            "clean_loss_at_step": round(reference, 4), "healthy": healthy,
            "other_anomalies": sorted({e.get("detector") for e in events if e["kind"] == "anomaly"}
                                      - set(case.detectors)),
            "wall_s": round(time.monotonic() - t0, 1)}


def _tail_mean(losses: dict[int, float], last: int, n: int = 20) -> float:
    """Mean loss of steps last-n+1..last (one batch's loss is noisy); nan if any is missing."""
    window = [losses.get(s, math.nan) for s in range(last - n + 1, last + 1)]
    return sum(window) / n


def clean_run(config: str, work: Path, steps: int, workers: int, limit: float) -> tuple[dict[int, float], dict]:
    case = Case(f"clean_{workers}w", "", (), workers=workers)
    run_dir = work / case.name
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("ANGEL_JAX_FAULTS", None)
    t0 = time.monotonic()
    rc = run(train_cmd(case, config, run_dir, steps), env, work / f"{case.name}.log", limit)
    records = {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl")}
    events = list(read_events(run_dir / "events.jsonl"))
    false = [e for e in events if e["kind"] in ("anomaly", "skipped")]
    return records, {"case": case.name, "workers": workers, "steps": steps, "exit_status": rc,
                     "final_step": max(records, default=0), "false_positives": len(false),
                     "false_positive_detectors": sorted({e.get("detector", e["kind"]) for e in false}),
                     "final_loss": round(records.get(steps, math.nan), 4), "wall_s": round(time.monotonic() - t0, 1)}


def table(rows: list[dict], cleans: list[dict], machine: dict) -> str:
    lines = [f"# Anomaly detection evaluation ({machine['device']}, {machine['cpu_count']} cores, "
             f"jax {machine['versions']['jax']}, {machine['date']})", "",
             "| fault | workers | detected | by | steps to detection | action taken | finished healthy (loss: mean "
             "of the last 20 steps) | other detectors |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        delay = r["steps_to_detection"]
        if r.get("seconds_without_progress") is not None:
            delay = f"{delay} ({r['seconds_without_progress']} s without progress)"
        lines.append(f"| `{r['fault']}` | {r['workers']} | {'yes' if r['detected'] else 'NO'} | {r['detector']} | "
                     f"{delay} | {r['action']} | "
                     f"{'yes' if r['healthy'] else 'NO'} (loss {r['final_loss']} vs clean {r['clean_loss_at_step']}) | "
                     f"{', '.join(r['other_anomalies']) or '-'} |")
    lines += ["", "| clean run | workers | steps | false positives |", "| --- | --- | --- | --- |"]
    for c in cleans:
        lines.append(f"| {c['case']} | {c['workers']} | {c['final_step']} | {c['false_positives']} "
                     f"{c['false_positive_detectors'] or ''} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="experiments/gpt_tiny.yaml")
    p.add_argument("--steps", type=int, default=400, help="steps of each fault run")
    p.add_argument("--at", type=int, default=300, help="step at which faults are injected")
    p.add_argument("--clean-steps", type=int, default=1000, help="steps of the clean runs (false positives)")
    p.add_argument("--cases", default=",".join(cases(0)), help="comma-separated case names")
    p.add_argument("--clean-workers", default="1,2", help="clean runs with these worker counts")
    p.add_argument("--limit", type=float, default=3600, help="seconds before a run is killed")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--write", action="store_true", help="append the figures to experiments/results/")
    args = p.parse_args(argv)

    machine = machine_info()
    work = Path(tempfile.mkdtemp(prefix="angel_jax_anomaly_eval_", dir=args.workdir))
    save = results_path("anomaly_eval") if args.write else None
    try:
        cleans, clean_losses = [], {}
        for workers in [int(w) for w in args.clean_workers.split(",") if w]:
            losses, summary = clean_run(args.config, work, args.clean_steps, workers, args.limit)
            clean_losses[workers] = losses
            cleans.append(summary)
            emit({"bench": "anomaly_eval", **summary}, save, machine)
        rows = []
        for name in [c for c in args.cases.split(",") if c]:
            case = cases(args.at)[name]
            clean = clean_losses.get(case.workers) or clean_losses.get(1, {})
            row = evaluate(case, args.config, work, args.steps, args.at, clean, args.limit)
            rows.append(row)
            emit({"bench": "anomaly_eval", **row}, save, machine)
        text = table(rows, cleans, machine)
        print(text)
        if save is not None:
            save.with_suffix(".md").write_text(text)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
