"""The largest GPT each runner trains for 2 steps on this machine, every run in its own capped process.

    python experiments/bench/scale.py [--runners plain,inmemory,paged] [--cap-gib 20] [--max-layers 64] [--write]
    python experiments/bench/scale.py --layers 1,2 --cap-gib 6          # just these depths (development)
    python experiments/bench/scale.py --dry                             # quick self-check on a tiny model

The model: experiments/gpt_tiny.yaml's byte-level GPT at d_model 2048, 16 heads, seq_len 128, batch 1, bf16
compute over fp32 parameters and optimizer state, blocks rematerialised; n_layers grows. Runners:

  plain     a minimal jitted optax adamw step written here (params and opt state donated), parameters built on
            the CPU with the model's init: the floor any engine is measured against
  inmemory  the project's training loop (`angel-jax train`) with memory.mode=in_memory, checkpoints off
  paged     the same loop with memory.mode=paged, the disk tier in the scratch directory, budgets from
            --device-budget-gib / --host-budget-gib (0 = the engine's defaults)

Every run is a child process of this script (nice 10, RLIMIT_AS = cap + --as-margin-gib as a backstop) that a
watchdog polls every 0.2 s: the RSS of the child and its descendants, and the bytes under the disk directory. A
child whose RSS passes the cap is SIGKILLed before the machine's OOM killer could act; peak RSS is the larger of
the polled figure and the ru_maxrss the child reports as it exits (a killed child reports nothing: polled). The
search per runner doubles n_layers from 1 while runs succeed (up to --max-layers), then bisects between the last
success and the first failure.
One JSON line per run on stdout (appended to experiments/results/scale_<platform>.jsonl with --write).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's angel_jax, not whichever one the environment installed
CONFIG = ROOT / "experiments" / "gpt_tiny.yaml"
GIB = 1 << 30
RUNNERS = ("plain", "inmemory", "paged")
MODEL = ["model.d_model=2048", "model.n_heads=16", "model.seq_len=128", "model.compute_dtype=bfloat16",
         "model.param_dtype=float32", "model.remat=true", "train.batch_size=1"]
DRY_MODEL = ["model.d_model=128", "model.n_heads=4"]
"""--dry: the same recipe on a 0.2M-parameter-per-block model."""


# ------------------------------------------------------------------------------------------------ pure helpers


def overrides(runner: str, n_layers: int, scratch: Path, args: argparse.Namespace) -> list[str]:
    """The config overrides of one run (on experiments/gpt_tiny.yaml)."""
    out = MODEL + (DRY_MODEL if args.dry else []) + [
        f"model.n_layers={n_layers}", f"train.steps={args.steps}", f"train.run_dir={scratch / 'run'}", "train.progress=false",
        "train.resume=false", "checkpoint.every=0", "checkpoint.at_end=false",
        f"checkpoint.memory_dir={scratch / 'ckpt_mem'}", f"data.dir={ROOT / 'data' / 'stdlib-byte'}"]
    if runner == "paged":
        out += ["memory.mode=paged", f"memory.disk_dir={scratch / 'disk'}",
                f"memory.device_budget={int(args.device_budget_gib * GIB)}",
                f"memory.host_budget={int(args.host_budget_gib * GIB)}"] + list(args.set)
    elif runner == "inmemory":
        out += ["memory.mode=in_memory"]
    return out


def search(trial: Callable[[int], bool], max_layers: int) -> int:
    """The largest n in [1, max_layers] for which `trial(n)` holds, assuming it is monotone (0 if none): doubling
    from 1, then bisection between the last success and the first failure."""
    good, bad, n = 0, max_layers + 1, 1
    while n <= max_layers:
        if not trial(n):
            bad = n
            break
        good, n = n, 2 * n
    if bad == max_layers + 1 and good < max_layers:  # doubled past the limit: try the limit itself
        if trial(max_layers):
            return max_layers
        bad = max_layers
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if trial(mid) else (good, mid)
    return good


def tree_rss(proc: psutil.Process) -> int:
    """RSS of a process and all its descendants (0 once it is gone)."""
    try:
        return sum(_rss(p) for p in [proc, *proc.children(recursive=True)])
    except psutil.Error:
        return 0


def _rss(p: psutil.Process) -> int:
    try:
        return p.memory_info().rss
    except psutil.Error:
        return 0


def dir_bytes(path: Path) -> int:
    """Bytes allocated on disk by the files under `path` (0 when it does not exist)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total


def failure_reason(returncode: int, killed: str | None, child: dict | None, stderr_tail: str) -> str:
    if killed:
        return killed
    if child is not None and child.get("error"):
        why = child["error"]
    elif returncode < 0:
        return f"killed by signal {-returncode} (not by this script)"
    else:
        lines = [line for line in stderr_tail.splitlines() if line.strip()]
        why = f"exit status {returncode}: {lines[-1] if lines else 'no output'}"
    if "allocat" in why:  # address space, not RSS: JAX maps more than it touches; --as-margin-gib raises it
        why += " (the RLIMIT_AS backstop, cap + --as-margin-gib, was hit)"
    return why


def watch(proc: subprocess.Popen, cap: int, disk: Path, timeout_s: float, min_free: int) -> tuple[int, int, str | None]:
    """Poll a child every 0.2 s until it exits: (peak RSS of its process tree, peak bytes under `disk`, why it was
    killed or None). SIGKILLs the tree when its RSS passes `cap`, when the machine's available memory falls below
    `min_free` (other work on the machine grew), or after `timeout_s`."""
    ps, peak_rss, peak_disk, t0 = psutil.Process(proc.pid), 0, 0, time.monotonic()
    while proc.poll() is None:
        rss, free = tree_rss(ps), psutil.virtual_memory().available
        peak_rss, peak_disk = max(peak_rss, rss), max(peak_disk, dir_bytes(disk))
        why = (f"OOM cap: RSS {rss} B passed the cap of {cap} B, killed" if rss > cap else
               f"machine low on memory: {free} B available, killed" if free < min_free else
               f"timeout: still running after {timeout_s:.0f} s, killed" if time.monotonic() - t0 > timeout_s else None)
        if why:
            for p in [*ps.children(recursive=True), ps]:
                try:
                    p.send_signal(signal.SIGKILL)
                except psutil.Error:
                    pass
            proc.wait()
            return peak_rss, peak_disk, why
        time.sleep(0.2)
    return peak_rss, peak_disk, None


# ------------------------------------------------------------------------------------------------ the child


def run_plain(cfg) -> dict:
    """train.steps steps of a minimal jitted adamw step, params and optimizer state donated."""
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import models

    model = models.get(cfg.model)
    with jax.default_device(jax.devices("cpu")[0]):
        graphdef, params = model.init(cfg.train.seed)
    tx = optax.adamw(cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay)
    opt_state = tx.init(params)

    def loss_fn(p, batch):
        return model.loss(nnx.merge(graphdef, p)(batch[:, :-1]), batch[:, 1:])

    def _step(p, o, batch):
        loss, grads = jax.value_and_grad(loss_fn)(p, batch)
        updates, o = tx.update(grads, o, p)
        return optax.apply_updates(p, updates), o, loss

    step = jax.jit(_step, donate_argnums=(0, 1))
    rng = np.random.default_rng(0)
    batch = jax.numpy.asarray(rng.integers(0, 256, (cfg.train.batch_size, cfg.model.seq_len + 1), dtype=np.int32))
    times, losses = [], []
    for _ in range(cfg.train.steps):
        t0 = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
        times.append(time.perf_counter() - t0)
    return {"step_s": times, "loss": losses}


def run_loop(cfg) -> dict:
    """Two steps of the project's training loop (what `angel-jax train` runs); for the paged engine also its plan."""
    from angel_jax.train import engines, loop

    built: list = []

    def capture(c, mesh):  # the loop builds its engine; keep a reference to read the plan afterwards
        built.append(engines.build_engine(c, mesh))
        return built[-1]

    loop.build_engine = capture
    steps: dict[int, dict] = {}
    loop.train(cfg, on_step=lambda step, values: steps.__setitem__(step, values))
    out = {"step_s": [steps[k].get("perf/step_time", steps[k].get("perf/first_step_time")) for k in sorted(steps)],
           "loss": [steps[k]["loss"] for k in sorted(steps)]}
    if cfg.memory.mode == "paged":
        b = built[-1].built
        out["plan"] = {**b.plan.summary(), "io_per_step": b.plan.io_per_step(b.costs, b.bandwidths),
                       "table": b.plan.table(b.costs)}
        # What the prediction rests on: the disk figures are defaults unless `angel-jax bench io` calibrated them.
        out["bandwidths"] = dataclasses.asdict(b.bandwidths)
        # Profiled compute per step on these cores: every forward (not the head's), backward and update.
        out["compute_s"] = sum(c.backward_s + (c.forward_s if i < len(b.costs) - 1 else 0.0)
                               + (c.update_device_s if b.plan.home[i] == "device" else c.update_host_s)
                               for i, c in enumerate(b.costs))
    return out


def child_main(args: argparse.Namespace) -> int:
    scratch = Path(args.scratch)
    out: dict = {}
    try:
        from angel_jax.config import load_config

        cfg = load_config(CONFIG, overrides(args.child, args.n_layers, scratch, args))
        out = run_plain(cfg) if args.child == "plain" else run_loop(cfg)
        out["ok"] = len(out["step_s"]) == args.steps
    except BaseException as e:  # noqa: BLE001 - report any failure (a refusal, an allocation failure) as data
        from angel_jax.errors import AngelError

        kind = "refused" if isinstance(e, AngelError) else \
            "allocation failed" if isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in str(e) else "error"
        out = {"ok": False, "error": f"{kind}: {type(e).__name__}: {str(e)[:500]}"}
        traceback.print_exc()
    out["child_maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(args.child_out).write_text(json.dumps(out))
    return 0 if out["ok"] else 1


# ------------------------------------------------------------------------------------------------ the parent


def run_trial(runner: str, n_layers: int, args: argparse.Namespace) -> dict:
    """One capped child run; returns its record."""
    scratch = Path(tempfile.mkdtemp(prefix=f"{runner}-{n_layers}-", dir=args.scratch))
    (scratch / "disk").mkdir()
    result = scratch / "child.json"
    cap, backstop = int(args.cap_gib * GIB), int((args.cap_gib + args.as_margin_gib) * GIB)
    # nice and prlimit exec the command: the child's pid is the Python process's.
    cmd = ["nice", "-n", "10", "prlimit", f"--as={backstop}", sys.executable, str(Path(__file__).resolve()),
           "--child", runner, "--n-layers", str(n_layers), "--scratch", str(scratch), "--child-out", str(result),
           "--steps", str(args.steps),
           "--device-budget-gib", str(args.device_budget_gib), "--host-budget-gib", str(args.host_budget_gib),
           *(["--dry"] if args.dry else []), *[f"--set={kv}" for kv in args.set]]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    t0 = time.perf_counter()
    with open(scratch / "stderr.log", "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=err, stderr=subprocess.STDOUT)
        peak_rss, peak_disk, killed = watch(proc, cap, scratch / "disk", args.timeout_s, int(args.min_free_gib * GIB))
    child = json.loads(result.read_text()) if result.exists() else None
    stderr_tail = (scratch / "stderr.log").read_text()[-4000:]
    ok = bool(child and child.get("ok")) and proc.returncode == 0 and not killed
    record = {
        "bench": "scale", "runner": runner, **model_fields(n_layers, args.dry, args.set),
        **({"overrides": list(args.set), "device_budget_gib": args.device_budget_gib,
            "host_budget_gib": args.host_budget_gib} if runner == "paged" else {}),
        "ok": ok, "why_not": None if ok else failure_reason(proc.returncode, killed, child, stderr_tail),
        "peak_rss_bytes": max(peak_rss, (child or {}).get("child_maxrss", 0)),
        "peak_rss_polled_bytes": peak_rss, "peak_disk_bytes": peak_disk,
        "step2_s": round(child["step_s"][1], 4) if ok and len(child["step_s"]) > 1 else None,  # (--steps 1: none)
        "step_s": [round(t, 4) for t in child["step_s"]] if ok else None,
        # The last step's time leaves out its own updates (they drain after it): a steady step needs a next one.
        "steady_step_s": round(child["step_s"][1], 4) if ok and args.steps >= 3 else None,
        "loss": child.get("loss") if child else None, "wall_s": round(time.perf_counter() - t0, 1),
        "cap_bytes": cap, "rlimit_as_bytes": backstop,
    }
    if runner == "paged" and child and "plan" in child:
        plan = child["plan"]
        # (with memory.overlap=false the predicted step is the serial one; serial_step_s is always the sum of parts)
        record.update(predicted_step_s=round(plan["predicted_step_s"], 4),
                      predicted_serial_step_s=round(plan["serial_step_s"], 4), compute_s=round(child["compute_s"], 4),
                      io_per_step=plan["io_per_step"],
                      io_bound_s=round(plan["io_per_step"]["io_bound_s"], 4), plan=plan,
                      bandwidths=child.get("bandwidths"))
    if not args.keep_scratch:
        shutil.rmtree(scratch, ignore_errors=True)
    return record


def model_fields(n_layers: int, dry: bool, sets: list[str] = ()) -> dict:
    """n_layers, parameter count and the model's shape, from the config alone (nothing allocated), with the run's
    --set overrides (a model.compute_dtype given there is the one recorded)."""
    import models
    from angel_jax.config import load_config

    cfg = load_config(CONFIG, MODEL + (DRY_MODEL if dry else []) + [f"model.n_layers={n_layers}", *sets])
    m = cfg.model
    n = models.get(m).param_count["total"]
    # fp32 parameters, gradients and Adam's two moments: the bytes any runner must hold at least.
    return {"n_layers": n_layers, "params": n, "state_bytes": 16 * n, "d_model": m.d_model,
            "n_heads": m.n_heads, "seq_len": m.seq_len, "batch_size": cfg.train.batch_size,
            "compute_dtype": m.compute_dtype, "param_dtype": m.param_dtype, "remat": m.remat}


def ensure_data() -> None:
    """Prepare the corpus once, outside any measured run."""
    from angel_jax.data import shards as data_lib

    data_lib.ensure_prepared(ROOT / "data" / "stdlib-byte", "stdlib", tokenizer="byte", vocab_size=256)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runners", default=",".join(RUNNERS), help="comma-separated subset of " + ",".join(RUNNERS))
    p.add_argument("--layers", default=None, help="run just these depths, e.g. 1,2 (no search)")
    p.add_argument("--steps", type=int, default=2, help="training steps per run (>= 3 measures a steady step: "
                   "the last step's time leaves out its own updates)")
    p.add_argument("--max-layers", type=int, default=64, help="largest n_layers the search tries")
    p.add_argument("--cap-gib", type=float, default=20.0, help="RSS cap per run (the watchdog kills above it)")
    p.add_argument("--as-margin-gib", type=float, default=4.0, help="RLIMIT_AS = cap + this (a backstop)")
    p.add_argument("--device-budget-gib", type=float, default=0.0, help="paged: memory.device_budget (0 = default)")
    p.add_argument("--host-budget-gib", type=float, default=0.0, help="paged: memory.host_budget (0 = default)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="paged: a further config override, e.g. memory.page_size=50348032 (repeatable)")
    p.add_argument("--min-free-gib", type=float, default=1.0,
                   help="kill a run when the machine's available memory falls below this (other work grew)")
    p.add_argument("--timeout-s", type=float, default=7200.0, help="per run")
    p.add_argument("--scratch", default=None, help="directory for run dirs and disk tiers (default: a temp dir)")
    p.add_argument("--keep-scratch", action="store_true", help="keep each run's directory (logs, timelines)")
    p.add_argument("--dry", action="store_true", help="self-check: d_model 128, depths 1..2, cap 3 GiB, no write")
    p.add_argument("--write", action="store_true", help="append the records to experiments/results/scale_<platform>"
                   ".jsonl")
    p.add_argument("--child", choices=RUNNERS, help=argparse.SUPPRESS)
    p.add_argument("--n-layers", type=int, help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child_main(args)
    if args.dry:
        args.max_layers, args.cap_gib, args.write = min(args.max_layers, 2), min(args.cap_gib, 3.0), False
    runners = [r for r in args.runners.split(",") if r]
    if unknown := set(runners) - set(RUNNERS):
        p.error(f"unknown runners {sorted(unknown)}; known: {', '.join(RUNNERS)}")
    from angel_jax.benchinfo import emit, machine_info, results_path

    ensure_data()
    machine, results = machine_info(), results_path("scale") if args.write else None
    own_scratch = args.scratch is None
    args.scratch = args.scratch or tempfile.mkdtemp(prefix="angel_scale-")
    Path(args.scratch).mkdir(parents=True, exist_ok=True)
    records: list[dict] = []

    def trial(runner: str, n: int) -> bool:
        records.append(run_trial(runner, n, args))
        emit(records[-1], results, machine)
        if (records[-1]["why_not"] or "").startswith("machine low"):  # says nothing about the runner: stop
            raise SystemExit(f"stopped: {records[-1]['why_not']}; other work needs the memory, try again later")
        return records[-1]["ok"]

    try:
        for runner in runners:
            if args.layers:
                for n in (int(x) for x in args.layers.split(",")):
                    trial(runner, n)
            else:
                best = search(lambda n: trial(runner, n), args.max_layers)
                emit({"bench": "scale", "figure": "largest", "runner": runner,
                      **(model_fields(best, args.dry, args.set) if best else {"n_layers": 0}),
                      "cap_bytes": int(args.cap_gib * GIB), "max_layers": args.max_layers}, results, machine)
    finally:
        if own_scratch and not args.keep_scratch:
            shutil.rmtree(args.scratch, ignore_errors=True)
    return self_check(records) if args.dry else 0


def self_check(records: list[dict]) -> int:
    """--dry: the search finds the limit of monotone fakes; every run trained and its record carries its figures."""
    for limit in range(0, 12):
        for top in (1, 3, 4, 8, 10):
            tried: list[int] = []
            found = search(lambda n: tried.append(n) or n <= limit, top)
            assert found == min(limit, top), (limit, top, found)
            assert len(tried) == len(set(tried)) and all(1 <= n <= top for n in tried), tried
    bad = [r for r in records if not r["ok"] or r["peak_rss_bytes"] <= 0 or r["step2_s"] is None
           or (r["runner"] == "paged" and "predicted_step_s" not in r)]
    print(f"dry run: search ok; {len(records)} runs, {len(bad)} bad" + (f": {bad}" if bad else ""), file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
