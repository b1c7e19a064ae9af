"""The paged engine on one GPU (H100 / H200): no slowdown for models that fit, and how far past HBM it goes.

    PYTHONPATH=. python experiments/bench/paged_gpu.py [--disk-dir DIR] [--write]
    PYTHONPATH=. python experiments/bench/paged_gpu.py --smoke          # CPU, tiny models, a minute: the plumbing

Figures (one JSON line each; appended to experiments/results/paged_gpu_<platform>.jsonl with --write, never with
--smoke):

  fits_auto        a model whose training state fits HBM: tokens/s of `memory.mode=auto` (which picks the in-memory
                   engine for it) and of the paged engine with every stage resident, each over the in-memory
                   reference, timed in alternating rounds (target: auto / reference >= 0.97)
  ladder           per engine, the largest GPT (a ladder of depths at the width of --width) that trains two steps:
                   the reference in HBM alone; the paged engine with its state in host RAM; the paged engine with
                   its optimizer state on disk (--disk-dir). Each rung runs in its own process (an out-of-memory
                   failure does not poison the next), under --rung-timeout (--smoke: in this process)
  beyond_hbm       tokens/s and MFU of the paged engine at twice the largest model the reference trains in HBM
  quarter_state    gpt_1b (experiments/gpt_1b.yaml) at 32 x 2048 tokens per step (micro-batches of 8): the
                   in-memory engine and the paged engine with a quarter of the training state's bytes as its
                   device budget, timed in alternating rounds; tokens/s and MFU of each and paged / in-memory
                   (target <= 1.3); --overrides key=value ... apply to both (e.g. the ZeRO-Offload layout:
                   model.param_dtype=bfloat16 optimizer.master_weights=true memory.staleness=1)

The host tier is pinned host memory, capped by XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB: each rung sets it, unless the
environment does, to what its plan puts in the host tier (schedule.pinned_limit.configure_pinned_limit; at 90% of
RAM the pool grew past the plan and a 9.7 B rung was killed for host memory); host updates run on the XLA CPU backend. MFU = 6 * N_matmul + 12 * L * d * T FLOPs per token (models/gpt.py)
over the device's dense bf16 peak (angel_jax/train/metrics.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


import jax  # noqa: E402
import numpy as np  # noqa: E402

from angel_jax.benchinfo import emit, machine_info, results_path  # noqa: E402
from angel_jax.config import Config, load_config  # noqa: E402
from angel_jax.memory.host_peak import peak_rss  # noqa: E402
from angel_jax.schedule.pinned_limit import configure_pinned_limit  # noqa: E402
from angel_jax.train.engines import build_engine, state_bytes  # noqa: E402
from angel_jax.train.metrics import device_peak, throughput  # noqa: E402
from models import gpt  # noqa: E402

GPU = {"config": "experiments/gpt_1b.yaml", "width": 4096, "heads": 32, "seq_len": 2048, "batch": 4,
       "fits_layers": 8, "ladder": [8, 12, 16, 20, 24, 32, 40, 48, 56, 64], "page_size": 256 * 2**20,
       "quarter": {"overrides": ["train.batch_size=32", "train.micro_batch_size=8"], "budget": None}}
"""At d_model 4096 a block holds 201M parameters (3.2 GB of fp32 parameters + Adam state): the reference's
ceiling on an 80 GB H100 is ~20 blocks (~4B parameters), host RAM (128 GB) holds ~7B, disk more."""
SMOKE = {"config": "experiments/gpt_tiny.yaml", "width": 64, "heads": 2, "seq_len": 32, "batch": 2,
         "fits_layers": 2, "ladder": [2], "page_size": 49 * 4096,
         "quarter": {"overrides": ["model.d_model=64", "model.n_heads=2", "model.n_layers=2", "model.seq_len=32",
                                   "train.batch_size=4", "train.micro_batch_size=2", "memory.page_size=200704"],
                     "budget": 1_500_000}}
"""`quarter`: the quarter_state figure's shape, and its device budget (None: a quarter of the state; the tiny
model's quarter holds no step, so the smoke run streams at a budget of its own)."""


def sized(sizes: dict, layers: int, *extra: str) -> Config:
    return load_config(ROOT / sizes["config"], [
        f"model.d_model={sizes['width']}", f"model.n_heads={sizes['heads']}", f"model.n_layers={layers}",
        f"model.seq_len={sizes['seq_len']}", f"train.batch_size={sizes['batch']}",
        f"memory.page_size={sizes['page_size']}", "train.steps=1000", *extra])


def _mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((1,), ("data",), devices=jax.devices()[:1], axis_types=(jax.sharding.AxisType.Auto,))


def _batches(cfg: Config, sharding: jax.sharding.Sharding, n: int = 2) -> list[jax.Array]:
    rng = np.random.default_rng(0)
    shape = (cfg.train.batch_size, cfg.model.seq_len + 1)
    return [jax.device_put(rng.integers(0, cfg.model.vocab_size, shape, dtype=np.int32), sharding) for _ in range(n)]


def timed(engine, batches: list, steps: int) -> float:
    """Seconds per step over `steps` back-to-back steps, until the last one's metrics (updates included) exist."""
    t0 = time.perf_counter()
    for k in range(steps):
        metrics = engine.step(batches[k % len(batches)])
    jax.block_until_ready({k: np.asarray(v) for k, v in metrics.items()})
    return (time.perf_counter() - t0) / steps


def perf(cfg: Config, step_s: float) -> dict:
    tokens = cfg.train.batch_size * cfg.model.seq_len
    out = throughput(step_s, tokens, gpt.flops_per_token(cfg.model), device_peak(jax.devices()[0]), 1)
    return {"tokens_per_s": round(out["perf/tokens_per_s"], 1), "mfu": round(out["perf/mfu"], 4)}


# --------------------------------------------------------------------------------------------- (a) fits


def fits_auto(sizes: dict, rounds: int, steps: int) -> dict:
    engines = {"reference": sized(sizes, sizes["fits_layers"], "memory.mode=in_memory"),
               "auto": sized(sizes, sizes["fits_layers"], "memory.mode=auto"),
               "paged_resident": sized(sizes, sizes["fits_layers"], "memory.mode=paged")}
    built, times = {}, {name: [] for name in engines}
    try:
        for name, cfg in engines.items():
            built[name] = build_engine(cfg, _mesh())
        batches = _batches(engines["reference"], built["reference"].batch_sharding)
        for engine in built.values():
            timed(engine, batches, 2)  # compile, warm up
        for _ in range(rounds):
            for name, engine in built.items():
                times[name].append(timed(engine, batches, steps))
        picked = built["auto"].name
        resident = built["paged_resident"].built.plan
    finally:
        for engine in built.values():
            engine.close()
    cfg = engines["reference"]
    med = {name: statistics.median(t) for name, t in times.items()}
    ratio = {name: statistics.median(r / a for r, a in zip(times["reference"], times[name])) for name in times}
    return {"figure": "fits_auto", "params": gpt.param_count(cfg.model)["total"], "state_bytes": state_bytes(cfg),
            "auto_picked": picked, "paged_resident_stages": f"{len(resident.resident)}/{len(resident.home)}",
            "step_s": {n: [round(x, 4) for x in t] for n, t in times.items()},
            **{f"{n}_{k}": v for n in med for k, v in perf(cfg, med[n]).items()},
            "auto_over_reference": round(ratio["auto"], 4),
            "paged_resident_over_reference": round(ratio["paged_resident"], 4),
            "target": 0.97, "meets_target": ratio["auto"] >= 0.97}


# --------------------------------------------------------------------------------------------- (b) quarter


def quarter_state(sizes: dict, rounds: int, steps: int, overrides: list[str]) -> dict:
    """The in-memory engine against the paged one holding a quarter of the training state on the device."""
    shape = sizes["quarter"]
    base = [*shape["overrides"], "train.steps=1000", *overrides]
    reference = load_config(ROOT / sizes["config"], [*base, "memory.mode=in_memory"])
    budget = shape["budget"] or state_bytes(reference) // 4
    configs = {"reference": reference,
               "paged": load_config(ROOT / sizes["config"], [*base, "memory.mode=paged",
                                                             f"memory.device_budget={budget}"])}
    built, times = {}, {name: [] for name in configs}
    try:
        for name, cfg in configs.items():
            t0 = time.perf_counter()
            built[name] = build_engine(cfg, _mesh())
            _progress(f"quarter_state: {name} built in {time.perf_counter() - t0:.1f} s")
        batches = _batches(reference, built["reference"].batch_sharding)
        for name, engine in built.items():
            _progress(f"quarter_state: {name} warm-up step {timed(engine, batches, 1):.2f} s")
        for _ in range(rounds):
            for name, engine in built.items():
                times[name].append(timed(engine, batches, steps))
        plan = built["paged"].built.plan
    finally:
        for engine in built.values():
            engine.close()
    med = {name: statistics.median(t) for name, t in times.items()}
    ratio = statistics.median(p / r for p, r in zip(times["paged"], times["reference"]))
    return {"figure": "quarter_state", "overrides": overrides, "params": gpt.param_count(reference.model)["total"],
            "state_bytes": state_bytes(reference), "device_budget": budget,
            "batch_size": reference.train.batch_size, "micro_batch_size": reference.train.micro_batch_size,
            "streamed": len(plan.streamed), "stages": len(plan.home), "passes": plan.passes,
            "staleness": plan.staleness, "streamed_device_updates": len(plan.streamed_device_updates),
            "activations_parked_bytes": plan.parked_bytes, "predicted_step_s": round(plan.predicted.step_time, 4),
            "step_s": {n: [round(x, 4) for x in t] for n, t in times.items()},
            **{f"{n}_{k}": v for n in med for k, v in perf(reference, med[n]).items()},
            "paged_over_reference": round(ratio, 4), "target": 1.3, "meets_target": ratio <= 1.3}


# --------------------------------------------------------------------------------------------- (c) ladder


def rung(mode: str, sizes_name: str, layers: int, disk_dir: str, steps: int) -> dict:
    """One rung, in this process: build the engine, train `steps` steps, report step time and placement."""
    sizes = SMOKE if sizes_name == "smoke" else GPU
    extra = {"reference": ["memory.mode=in_memory"], "paged_host": ["memory.mode=paged"],
             "paged_disk": ["memory.mode=paged", f"memory.disk_dir={disk_dir}"]}[mode]
    if sizes_name == "smoke" and mode != "reference":  # small budgets, so the tiny models really page
        extra += ["memory.device_budget=1400000"] + (["memory.host_budget=2400000"] if mode == "paged_disk" else [])
    if mode == "paged_disk" and sizes_name != "smoke":
        # Host RAM for parameters and gradients; the optimizer state beyond what is left goes to disk.
        import psutil

        extra.append(f"memory.host_budget={int(psutil.virtual_memory().available * 0.6)}")
    cfg = sized(sizes, layers, *extra)
    pinned_line = configure_pinned_limit(cfg)  # (this process's GPU client has not started yet)
    if pinned_line:
        _progress(pinned_line)
    t0 = time.perf_counter()
    engine = build_engine(cfg, _mesh())
    try:
        build_s = time.perf_counter() - t0
        plan = getattr(getattr(engine, "built", None), "plan", None)
        _progress(f"{mode} {layers} layers: {engine.name} engine built in {build_s:.1f} s"
                  + (f"; {len(plan.streamed)} of {len(plan.home)} stages streamed, predicted step "
                     f"{plan.predicted.step_time:.3f} s" if plan is not None else ""))
        batches = _batches(cfg, engine.batch_sharding)
        first = timed(engine, batches, 1)
        _progress(f"first step {first:.2f} s")
        timed(engine, batches, 2)  # the rest of the warm-up (first uses of small host-side computations)
        step_s = timed(engine, batches, steps)
        _progress(f"step {step_s:.3f} s")
        placement = {}
        if engine.name == "paged":
            plan = engine.built.plan
            placement = {"streamed": len(plan.streamed), "stages": len(plan.home),
                         "params_on_disk": plan.home.count("disk"), "grads_on_disk": plan.grad_home.count("disk"),
                         "opt_on_disk": plan.opt_home.count("disk"), "peak_bytes": plan.peak_bytes,
                         "streamed_device_updates": len(plan.streamed_device_updates),
                         "activations_parked_bytes": plan.parked_bytes,
                         "predicted_step_s": round(plan.predicted.step_time, 4)}
    finally:
        engine.close()
    return {"ok": True, "mode": mode, "layers": layers, "params": gpt.param_count(cfg.model)["total"],
            "state_bytes": state_bytes(cfg), "engine": engine.name, "build_s": round(build_s, 1),
            "first_step_s": round(first, 3), "step_s": round(step_s, 4), **perf(cfg, step_s), **placement,
            "pinned_limit_gib": os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"),
            "peak_rss_bytes": peak_rss()}


def _progress(line: str) -> None:
    """A rung's progress on stderr: a rung killed at its time limit still says how far it got."""
    print(f"# {line}", file=sys.stderr, flush=True)


def run_rung(mode: str, sizes_name: str, layers: int, disk_dir: str, steps: int, timeout: float) -> dict:
    if sizes_name == "smoke":  # tiny models cannot run out of memory: spare the process start-ups
        try:
            return rung(mode, sizes_name, layers, disk_dir, steps)
        except Exception as e:  # noqa: BLE001 - a failed rung is a result
            return {"ok": False, "mode": mode, "layers": layers, "error": f"{type(e).__name__}: {e}"[-400:]}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--rung", mode, str(layers), "--sizes", sizes_name,
           "--disk-dir", disk_dir, "--steps", str(steps)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        got = " | ".join(line for line in err.splitlines() if line.startswith("# "))
        return {"ok": False, "mode": mode, "layers": layers,
                "error": f"timed out after {timeout:.0f} s" + (f"; got to: {got}"[-400:] if got else "")}
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"ok"')]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"ok": False, "mode": mode, "layers": layers, "error": " | ".join(tail)[-400:]}


def ladder(sizes: dict, sizes_name: str, disk_dir: str, steps: int, timeout: float, deadline: float) -> dict:
    """Climb each engine's ladder until a rung fails (or time runs out); the last rung that trained counts."""
    best, tried = {}, []
    for mode in ("reference", "paged_host", "paged_disk"):
        start = sizes["ladder"].index(best["reference"]["layers"]) if "reference" in best and mode != "reference" \
            else 0
        for layers in sizes["ladder"][start:]:
            if time.time() > deadline:
                tried.append({"ok": False, "mode": mode, "layers": layers, "error": "benchmark time budget spent"})
                break
            result = run_rung(mode, sizes_name, layers, disk_dir, steps, timeout)
            tried.append(result)
            print(json.dumps({"rung": result}), flush=True)
            if not result["ok"]:
                break
            best[mode] = result
    return {"figure": "ladder", "width": sizes["width"], "seq_len": sizes["seq_len"], "batch": sizes["batch"],
            "largest": {m: {k: r[k] for k in ("layers", "params", "state_bytes", "step_s", "tokens_per_s", "mfu")}
                        for m, r in best.items()}, "rungs": tried}


# --------------------------------------------------------------------------------------------- (d) beyond


def beyond_hbm(sizes: dict, sizes_name: str, ladder_fig: dict, disk_dir: str, steps: int, timeout: float) -> dict:
    ref = ladder_fig["largest"].get("reference")
    layers = 2 * (ref["layers"] if ref else sizes["ladder"][0])
    result = run_rung("paged_host", sizes_name, layers, disk_dir, steps, timeout)
    if not result["ok"]:  # host RAM too small for twice the HBM model: put the optimizer state on disk
        result = run_rung("paged_disk", sizes_name, layers, disk_dir, steps, timeout)
    return {"figure": "beyond_hbm", "reference_layers": ref["layers"] if ref else None, **result}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny models on any backend (checks the plumbing)")
    p.add_argument("--disk-dir", default="/tmp/angel_jax_paged_gpu", help="disk tier directory for the ladder")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="timed steps per round / per rung")
    p.add_argument("--rung-timeout", type=float, default=540.0, help="seconds per ladder rung")
    p.add_argument("--budget-s", type=float, default=3000.0, help="stop climbing the ladders after this long")
    p.add_argument("--skip", nargs="*", default=[], choices=["fits_auto", "quarter_state", "ladder", "beyond_hbm"])
    p.add_argument("--overrides", nargs="*", default=[], metavar="KEY=VALUE",
                   help="quarter_state: config overrides for both engines")
    p.add_argument("--write", action="store_true", help="append the figures to experiments/results/")
    p.add_argument("--rung", nargs=2, metavar=("MODE", "LAYERS"), help=argparse.SUPPRESS)
    p.add_argument("--sizes", default="gpu", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rung:
        print(json.dumps(rung(args.rung[0], args.sizes, int(args.rung[1]), args.disk_dir, args.steps)), flush=True)
        return 0
    sizes_name = "smoke" if args.smoke else "gpu"
    sizes = SMOKE if args.smoke else GPU
    if args.smoke:
        args.rounds, args.steps = 1, min(args.steps, 2)
    Path(args.disk_dir).mkdir(parents=True, exist_ok=True)
    save = results_path("paged_gpu") if args.write and not args.smoke else None
    machine = machine_info()
    deadline = time.time() + args.budget_s
    if "fits_auto" not in args.skip:
        emit({"bench": "paged_gpu", "smoke": args.smoke, **fits_auto(sizes, args.rounds, args.steps)}, save, machine)
    if "quarter_state" not in args.skip:
        emit({"bench": "paged_gpu", "smoke": args.smoke, **quarter_state(sizes, args.rounds, args.steps,
                                                                          args.overrides)}, save, machine)
    fig = None
    if "ladder" not in args.skip:
        fig = ladder(sizes, sizes_name, args.disk_dir, args.steps, args.rung_timeout, deadline)
        emit({"bench": "paged_gpu", "smoke": args.smoke, **fig}, save, machine)
    if "beyond_hbm" not in args.skip:
        fig = fig or {"largest": {}}
        emit({"bench": "paged_gpu", "smoke": args.smoke,
              **beyond_hbm(sizes, sizes_name, fig, args.disk_dir, args.steps, args.rung_timeout)}, save, machine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
