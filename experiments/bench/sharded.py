"""The sharded (ZeRO-3) paged engine on N = 1, 2, 4 CPU devices and on 2 processes x 1 device: what each rank
holds, how long a step takes, what the plan predicted, and how many bytes the collectives move.

    python experiments/bench/sharded.py [--ns 1,2,4] [--no-processes] [--rounds R] [--steps S] [--warmup W]
                                        [--d-model D] [--write]

Every configuration runs in its own child process (a CPU device count is fixed when jax starts): N forced host
devices (XLA_FLAGS=--xla_force_host_platform_device_count=N, one process; N = 1 is the single-device paged engine,
the unsharded baseline), and 2 processes of one CPU device each (jax.distributed, gloo collectives). Each child
runs under `timeout -s KILL` and `prlimit --as`.

Model: GPT, d_model 128, 24 layers, 2 heads, seq 16, float32 compute, AdamW; a global batch of 8 rows (divisible
by 4). The page size is the rank's: memory.page_size is 1/N of a block's parameter bytes, rounded up (a rank's
page holds its chunk of one block: few pages, little padding). The device budget
per rank is half of 1/N of the training state (fp32 parameters + Adam moments, 12 B per parameter), so most
stages stream. The same synthetic token batches feed every engine.

Engines timed in one child, in alternating rounds (each round: S steps dispatched back to back, timed until the
last one's loss exists and, for the paged engine, its host updates are installed; the median over rounds is
reported):

    paged             the paged engine (build_engine, memory.mode=paged, mesh.fsdp=N): ZeRO-3 pages for N > 1
    reference         the in-memory engine on one device, same model and batch (the single-device reference);
                      in the 2-process run it is not timed there (a single-device engine inside a 2-process job
                      is not a configuration the engines support), the N = 1 child's median is used instead
    in_memory_sharded the in-memory engine with mesh.fsdp=N (NamedSharding, XLA's partitioner), N > 1

Figures (one JSON line each, with n, kind "devices" / "processes", the machine, versions and date, appended to
experiments/results/sharded_cpu.jsonl with --write):

  per_rank_bytes     after the warm-up steps, every update landed (store.wait_all): per device, the bytes of the
                     arrays the store's device tier and host tier hold (`addressable_shards` of each tier's
                     arrays, summed by device), and the bytes of each page's home copy (the state a rank owns).
                     The ratio of a rank's home bytes to the N = 1 engine's total home bytes has the goal
                     1/N within 5% (padding of the rank chunks makes it slightly above). In the 2-process run
                     each process reports its own device.
  step_time          median paged step / median reference step (and / the sharded in-memory engine's).
  predicted_vs_measured  engine.built.plan.predicted.step_time / the measured paged median - 1 (goal within 25%).
  collective_bytes   measured from the compiled programs: every stage function the engine builds goes through
                     `Zero.stage_jit`; for one step after the timed rounds, that method is wrapped so that each
                     call is counted and, once per (function, argument shapes), the call's program is lowered and
                     compiled with the same arguments and its optimized HLO text is scanned for collective
                     instructions (all-gather, reduce-scatter, all-reduce, their async -start forms) with their
                     operand and result shapes. Per rank, an all-gather receives result - operand bytes, a
                     reduce-scatter sends operand - result bytes, an all-reduce moves its operand (counted
                     separately: the scalars reduced over the ranks, norms and the loss). Summed over the step's
                     calls, against 3 x parameter bytes x (N - 1) / N (forward gather, backward gather,
                     gradient reduce-scatter; parameter bytes = 4 B x parameters, no padding). The optimizer
                     updates (`Zero.update_spmd`) are not counted: they run on each rank's own shards and reduce
                     only scalars (zero.py). The wrapping is the benchmark's own and is removed before anything
                     else runs.

CPU caveat: the CPU backend runs programs with collectives one at a time (zero.py `Zero.serial`: every stage call
waits for its results), and its "devices" are threads of one 2-core machine sharing one RAM, so a sharded step
here is slower than the single-device one, and a step on N forced devices does not get N times the compute.
These figures check the bytes and the plan's model of the step, not the speed-up an accelerator would give.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from angel_jax.memory.malloc import with_huge_pages  # noqa: E402  (children start as the launcher starts workers)

BATCH = 8
SEQ = 16
LAYERS = 24
CHILD_LIMIT_S = 900
MEMORY_CAP = 6 << 30
"""prlimit --as per child: address space, not resident memory (XLA reserves more than it touches)."""
STATE_COPIES = 3
"""fp32 parameters + Adam's two moments."""
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[^\s=]+)\s*=\s*(?P<type>.*?)\s+(?P<op>[a-z][a-z0-9-]*)\("
                         r"(?P<args>[^)]*)\)")
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
SHAPE = re.compile(r"\b(?P<dtype>pred|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64)\[(?P<dims>[0-9,]*)\]")
ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
            "s64": 8, "u64": 8, "f64": 8}


# ------------------------------------------------------------------------------------------------ the child
def config(n: int, d_model: int, mode: str, fsdp: int = 1):
    from angel_jax.config import Config, MemoryConfig, MeshConfig, ModelConfig, OptimizerConfig, TrainConfig

    model = ModelConfig(d_model=d_model, n_layers=LAYERS, n_heads=2, seq_len=SEQ, compute_dtype="float32")
    cfg = Config(model=model, optimizer=OptimizerConfig(name="adamw", lr=1e-3, warmup_steps=2),
                 train=TrainConfig(steps=1000, batch_size=BATCH, run_dir=tempfile.mkdtemp(prefix="sharded_bench_"),
                                   progress=False),
                 mesh=MeshConfig(fsdp=fsdp))
    page = page_size(n, d_model)
    budget = state_bytes(cfg) // n // 2
    return dataclasses.replace(cfg, memory=MemoryConfig(mode=mode, page_size=page, device_budget=budget))


def page_size(n: int, d_model: int) -> int:
    """A rank's page: its 1/N of a block's parameters (12 d^2 + 13 d float32), rounded up to 512 B, plus 512 B
    for the rounding up of each leaf's chunk (at N = 1, d 64: 200,704 B, tests/test_paged.py's page)."""
    block = (12 * d_model ** 2 + 13 * d_model) * 4
    return -(-block // n // 512) * 512 + 512


def param_count(cfg) -> int:
    import models

    return int(models.get(cfg.model).param_count["total"])


def state_bytes(cfg) -> int:
    return STATE_COPIES * 4 * param_count(cfg)


def batches(cfg, count: int = 4) -> list:
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.integers(0, cfg.model.vocab_size, (BATCH, SEQ + 1), dtype=np.int32) for _ in range(count)]


def tier_bytes(store) -> dict[str, dict[str, int]]:
    """Per tier (device, host), per device: the bytes of the addressable shards of every array the tier holds."""
    out: dict[str, dict[str, int]] = {}
    for name in ("device", "host"):
        per: dict[str, int] = collections.defaultdict(int)
        for arr in list(getattr(store.tiers[name], "_arrays", {}).values()):
            for shard in arr.addressable_shards:
                per[str(shard.device)] += int(shard.data.nbytes)
        out[name] = dict(per)
    return out


def home_bytes(store) -> dict[str, int]:
    """Per device: the bytes of every page's home copy (the state each rank owns), wherever its home is."""
    per: dict[str, int] = collections.defaultdict(int)
    for pid in store.page_ids():
        arr = getattr(store.tiers[store.home(pid)], "_arrays", {}).get(pid)
        if arr is None:
            raise RuntimeError(f"page {pid}: no array in its home tier {store.home(pid)!r}")
        for shard in arr.addressable_shards:
            per[str(shard.device)] += int(shard.data.nbytes)
    return dict(per)


def hlo_collectives(text: str) -> list[dict[str, Any]]:
    """The collective instructions of an optimized HLO module: op, result bytes, operand bytes. Operands are
    printed by name only; their shapes are those of the instructions (and parameters) of that name."""
    def nbytes(s: str) -> int:
        total = 0
        for m in SHAPE.finditer(s):
            count = 1
            for d in filter(None, m["dims"].split(",")):
                count *= int(d)
            total += count * ITEMSIZE[m["dtype"]]
        return total

    sizes: dict[str, int] = {}
    instructions = []
    for line in text.splitlines():
        m = INSTRUCTION.match(line)
        if m:
            sizes[m["name"]] = nbytes(m["type"])
            instructions.append(m)
    found = []
    for m in instructions:
        op = m["op"].removesuffix("-start")
        if op not in COLLECTIVES:
            continue
        operand = sum(sizes[a.strip().lstrip("%")] for a in m["args"].split(",") if a.strip().startswith("%"))
        result = sizes[m["name"]]
        if m["op"].endswith("-start") and op == "all-gather":  # the result is the tuple (operands, results)
            result -= operand
        found.append({"op": op, "result": result, "operand": operand})
    return found


class CollectiveCounter:
    """Wraps `Zero.stage_jit` while `active`: counts each stage function's calls and reads the collectives of the
    program each distinct call runs (lowered and compiled again with the call's arguments)."""

    def __init__(self):
        self.active = False
        self.calls: collections.Counter = collections.Counter()
        self.programs: dict[tuple, list[dict]] = {}

    def install(self) -> Callable[[], None]:
        from angel_jax.schedule import zero as zero_mod

        original = zero_mod.Zero.stage_jit
        counter = self

        def stage_jit(self, fn, signature):
            run = original(self, fn, signature)
            jitted = run if hasattr(run, "lower") else _closed_over_jit(run)

            def call(*args):
                if counter.active:
                    import jax

                    key = (signature, id(fn), tuple((tuple(a.shape), str(a.dtype)) for a in jax.tree.leaves(args)))
                    counter.calls[key] += 1
                    if key not in counter.programs:
                        counter.programs[key] = hlo_collectives(jitted.lower(*args).compile().as_text())
                return run(*args)

            return call

        zero_mod.Zero.stage_jit = stage_jit
        return lambda: setattr(zero_mod.Zero, "stage_jit", original)

    def per_step(self) -> dict[str, Any]:
        moved = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0, "other": 0}
        ops = collections.Counter()
        for key, calls in self.calls.items():
            for c in self.programs[key]:
                ops[c["op"]] += calls
                if c["op"] == "all-gather":
                    moved["all_gather"] += calls * (c["result"] - c["operand"])
                elif c["op"] == "reduce-scatter":
                    moved["reduce_scatter"] += calls * (c["operand"] - c["result"])
                elif c["op"] == "all-reduce":
                    moved["all_reduce"] += calls * c["operand"]
                else:
                    moved["other"] += calls * c["operand"]
        by_signature = collections.Counter()
        for (signature, _, _), calls in self.calls.items():
            by_signature[signature] += calls
        return {"bytes": moved, "ops": dict(ops), "calls": dict(by_signature)}


def _closed_over_jit(fn: Callable) -> Any:
    """The jitted program a `Zero.stage_jit` result wraps (`_waited` on the CPU backend)."""
    for cell in fn.__closure__ or ():
        if hasattr(cell.cell_contents, "lower"):
            return cell.cell_contents
    raise RuntimeError("Zero.stage_jit returned a function without a jitted program to read")


def timed_round(step: Callable, data: list, steps: int, settle: Callable[[], None] = lambda: None) -> float:
    """Seconds per step over `steps` steps dispatched back to back, until the last one's loss exists and
    `settle()` returned (the paged engine's: its updates installed, so that none runs on into the next engine's
    round, where the CPU backend would serialise it with that engine's collectives)."""
    import jax
    import numpy as np

    t0 = time.perf_counter()
    for k in range(steps):
        metrics = step(data[k % len(data)])
    jax.block_until_ready(np.asarray(metrics["loss"]))
    settle()
    return (time.perf_counter() - t0) / steps


def child(args: argparse.Namespace) -> None:
    """One configuration: prints one JSON line of raw measurements (process 0 only in the 2-process run)."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    processes = args.child == "processes"
    if processes:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}", num_processes=2,
                                   process_id=args.process_id)
    from angel_jax.benchinfo import machine_info
    from angel_jax.config import MeshConfig
    from angel_jax.train.engines import InMemoryEngine, build_engine
    from angel_jax.train.sharding import make_mesh

    n = jax.device_count()
    counter = CollectiveCounter()
    uninstall = counter.install()
    cfg = config(n, args.d_model, "paged", fsdp=n)
    raw = batches(cfg)
    rows = slice(jax.process_index() * BATCH // jax.process_count(), (jax.process_index() + 1) * BATCH // jax.process_count())

    def feeder(engine) -> list:
        if processes:
            return [jax.make_array_from_process_local_data(engine.batch_sharding, b[rows]) for b in raw]
        return [jax.device_put(b, engine.batch_sharding) for b in raw]

    t0 = time.perf_counter()
    paged = build_engine(cfg, make_mesh(MeshConfig(fsdp=n), jax.devices()))
    build_s = time.perf_counter() - t0
    engines: dict[str, Any] = {"paged": (paged, feeder(paged))}
    if not processes:
        ref_cfg = config(n, args.d_model, "in_memory")
        ref = InMemoryEngine(ref_cfg, make_mesh(MeshConfig(fsdp=1), jax.devices()[:1]))
        engines["reference"] = (ref, feeder(ref))
    if n > 1:
        sh_cfg = config(n, args.d_model, "in_memory", fsdp=n)
        sharded = InMemoryEngine(sh_cfg, make_mesh(MeshConfig(fsdp=n), jax.devices()))
        engines["in_memory_sharded"] = (sharded, feeder(sharded))
    for engine, data in engines.values():
        timed_round(engine.step, data, args.warmup)
    store = paged.built.store
    paged.built.updater.drain()  # every update installed: no page is between its donation and its new version
    store.wait_all()
    tiers, homes = tier_bytes(store), home_bytes(store)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, (engine, data) in engines.items():
            settle = paged.built.updater.drain if name == "paged" else (lambda: None)
            times[name].append(timed_round(engine.step, data, args.steps, settle))
    counter.active = True
    timed_round(paged.step, engines["paged"][1], 1)
    counter.active = False
    uninstall()
    paged.built.updater.drain()
    store.wait_all()
    plan = paged.built.plan
    out = {
        "n": n, "kind": args.child, "processes": jax.process_count(), "process_index": jax.process_index(),
        "params": param_count(cfg), "state_bytes": state_bytes(cfg), "page_size": cfg.memory.page_size,
        "device_budget_per_rank": cfg.memory.device_budget, "batch_size": BATCH, "d_model": args.d_model,
        "stages": len(plan.home), "streamed": len(plan.streamed), "prefetch": plan.prefetch,
        "engine_build_s": round(build_s, 2), "tiers": tiers, "homes": homes,
        "tiers_after": tier_bytes(store), "predicted_step_s": plan.predicted.step_time,
        "step_s": times, "collectives": counter.per_step() if n > 1 else None,
        "machine": machine_info(),
    }
    for engine, _ in engines.values():
        engine.close()
    if jax.process_index() == 0:
        print("RESULT " + json.dumps(out), flush=True)
    if processes:
        jax.distributed.shutdown()


# ------------------------------------------------------------------------------------------------ the parent
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(args: argparse.Namespace, *extra: str) -> list[str]:
    return ["timeout", "-s", "KILL", str(CHILD_LIMIT_S), "prlimit", f"--as={MEMORY_CAP}", sys.executable,
            str(Path(__file__).resolve()), "--rounds", str(args.rounds), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--d-model", str(args.d_model), *extra]


def _result(stdout: str) -> dict:
    for line in reversed(stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError("the child printed no result")


def run_devices(args: argparse.Namespace, n: int) -> dict:
    env = {**with_huge_pages(os.environ), "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"}
    proc = subprocess.run(_command(args, "--child", "devices"), env=env, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"N={n} devices: exit {proc.returncode}\n{proc.stderr[-4000:]}")
    return _result(proc.stdout)


def run_processes(args: argparse.Namespace) -> dict:
    env = {**with_huge_pages(os.environ), "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    port = str(_free_port())
    procs = [subprocess.Popen(_command(args, "--child", "processes", "--port", port, "--process-id", str(r)), env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT) for r in (0, 1)]
    outputs = [p.communicate() for p in procs]
    for r, (p, (_, err)) in enumerate(zip(procs, outputs)):
        if p.returncode != 0:
            raise RuntimeError(f"2 processes: process {r} exit {p.returncode}\n{err[-4000:]}")
    return _result(outputs[0][0])


def figures(results: list[dict], save: bool) -> None:
    from angel_jax.benchinfo import emit

    path = ROOT / "experiments" / "results" / "sharded_cpu.jsonl" if save else None
    base = next(r for r in results if r["n"] == 1)
    whole = sum(base["homes"].values())
    ref_median = statistics.median(base["step_s"]["reference"])
    for r in results:
        n, machine = r["n"], r.pop("machine")
        med = {name: statistics.median(ts) for name, ts in r["step_s"].items()}
        common = {"bench": "sharded", "n": n, "kind": r["kind"], "processes": r["processes"],
                  "d_model": r["d_model"], "n_layers": LAYERS, "seq_len": SEQ, "batch_size": r["batch_size"],
                  "params": r["params"], "state_bytes": r["state_bytes"], "page_size_per_rank": r["page_size"],
                  "device_budget_per_rank": r["device_budget_per_rank"], "stages": r["stages"],
                  "streamed": r["streamed"], "prefetch": r["prefetch"]}
        rank_home = list(r["homes"].values())
        ratios = [h / whole for h in rank_home]
        worst = max(abs(x * n - 1) for x in ratios)
        emit({**common, "figure": "per_rank_bytes", "reported_by": "process 0" if r["kind"] == "processes" else
              "all devices", "device_tier_bytes": r["tiers"]["device"], "host_tier_bytes": r["tiers"]["host"],
              "home_bytes": r["homes"], "whole_state_bytes_n1": whole, "ratio_to_n1": [round(x, 5) for x in ratios],
              "target_ratio": round(1 / n, 5), "max_relative_excess": round(worst, 5), "target": 0.05,
              "meets_target": worst <= 0.05}, path, machine)
        ref = med.get("reference", ref_median)
        row = {**common, "figure": "step_time", "rounds": len(r["step_s"]["paged"]),
               "step_s": {k: [round(t, 4) for t in ts] for k, ts in r["step_s"].items()},
               "step_s_median": {k: round(t, 4) for k, t in med.items()},
               "reference_from": "this run" if "reference" in med else "the N=1 devices run",
               "paged_over_reference": round(med["paged"] / ref, 4)}
        if "in_memory_sharded" in med:
            row["paged_over_in_memory_sharded"] = round(med["paged"] / med["in_memory_sharded"], 4)
            row["in_memory_sharded_over_reference"] = round(med["in_memory_sharded"] / ref, 4)
        emit(row, path, machine)
        error = r["predicted_step_s"] / med["paged"] - 1
        emit({**common, "figure": "predicted_vs_measured", "predicted_step_s": round(r["predicted_step_s"], 4),
              "measured_step_s": round(med["paged"], 4), "relative_error": round(error, 4), "target": 0.25,
              "meets_target": abs(error) <= 0.25}, path, machine)
        if n > 1:
            c = r["collectives"]
            theory = 3 * 4 * r["params"] * (n - 1) / n
            measured = c["bytes"]["all_gather"] + c["bytes"]["reduce_scatter"]
            emit({**common, "figure": "collective_bytes", "per_rank_bytes": c["bytes"], "ops": c["ops"],
                  "stage_calls": c["calls"], "gathered_plus_scattered": measured,
                  "theory_3_param_bytes_n1_over_n": round(theory), "measured_over_theory": round(measured / theory, 4)},
                  path, machine)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ns", default="1,2,4", help="device counts of the one-process runs (must include 1)")
    p.add_argument("--no-processes", action="store_true", help="skip the 2-process run")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="steps per timed round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per engine after compiling")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--write", action="store_true", help="append the figures to experiments/results/")
    p.add_argument("--child", choices=("devices", "processes"), help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0
    results = []
    for n in (int(x) for x in args.ns.split(",")):
        t0 = time.perf_counter()
        results.append(run_devices(args, n))
        print(f"# N={n} devices: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    if not args.no_processes:
        t0 = time.perf_counter()
        results.append(run_processes(args))
        print(f"# 2 processes: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    figures(results, args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
