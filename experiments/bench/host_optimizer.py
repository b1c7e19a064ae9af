"""Throughput of the host optimizer (the stage update streamed stages run on the host) against this machine's
memory-bandwidth bound, and how many cores it keeps busy.

    python experiments/bench/host_optimizer.py [CONFIG] [key=value ...] [--repeats R] [--gib G] [--write]

The stage timed is one block of the config's model (default: experiments/gpt_tiny.yaml and its optimizer, AdamW,
with model.d_model=2048: 50 M parameters, 201 MB in float32), with the page size set to the block's parameter
bytes so that no page carries padding. The update is the engine's own: `blueprint(cfg).updates.get(kind, host
compute, donate_params=True)`, called as `angel_jax.schedule.costs.profile_costs` calls it, on the host
placement (on the CPU backend: the CPU device's pinned_host memory, computed in place), on fresh pages each call
(setup untimed). The bytes it must move are the stage's parameters read and written, its gradients read and its
optimizer-state pages (Adam's two moments, in the config's state dtype; with optimizer.master_weights also the
float32 master) read and written: 7 x 4 B per parameter for AdamW in float32; 22 B for bfloat16 parameters
with a float32 master and bfloat16 moments. Padding, scalars and any temporaries XLA adds are not counted.

The bound is measured in the same run, in a child process with malloc's huge pages as the update's (below), each
way over arrays of --gib GiB (default 1), counting bytes read plus bytes written, best of --repeats:

  numpy copy       np.copyto, one thread (numpy's own), and split over every core (one thread per core; copyto
                   releases the GIL)
  numpy triad      a = b + s*c in numpy, as np.multiply(c, s, out=a); np.add(a, b, out=a) (5 arrays moved)
  XLA triad        jit(lambda b, c: b + s*c) on the CPU backend with b donated: one fused loop, XLA's threads

Figures (one JSON line each, appended to experiments/results/host_optimizer_<platform>.jsonl with --write):

  bandwidth        every bound above in GB/s and the best one, `bound_gbs`
  update           the stage update's median and best seconds, bytes moved, achieved GB/s (from the median),
                   `ratio` = achieved / bound (goal >= 0.70), who ran it (`update_by`: "host kernel" for AdamW in
                   float32 where the kernel builds, optim/fused.py; else "xla"), CPU time / wall time during the
                   timed calls (`cpu_per_wall`: above 1 means more than one core worked), the cores available
                   (`cores`) and page faults per call. Where XLA compiled the update: the most parts XLA splits one
                   loop of it into to run on its threads (`xla_loop_partitions`, the loop fusions'
                   outer_dimension_partitions) and the bytes it really reads and writes by XLA's own cost analysis
                   (`xla_bytes_accessed`: intermediates it keeps in memory included), per byte needed and per
                   second (`xla_traffic_gbs`).
                   The update is timed in child processes: started as the launcher starts its workers, with
                   malloc's huge pages (GLIBC_TUNABLES, angel_jax/memory/malloc.py); without them
                   (`without_huge_pages_s`, `speedup_huge_pages`); with them, pinned to one core (`one_core_s`,
                   `speedup_all_cores`); with them and `optimizer.host_kernel=false`, XLA's flat update
                   (optim/flat.py: `xla_flat_s`, its loop partitions and bytes per byte needed, `speedup_kernel` =
                   xla_flat_s / the update's median); and the leaf-wise update the engine runs for optimizers that
                   are not element-wise (optim/stage_update.py: unpack, optax per leaf, pack), which was every
                   optimizer's before the flat update: `leafwise_s`, `leafwise_xla_bytes_per_byte_needed`,
                   `speedup_flat` (= leafwise_s / xla_flat_s). All timed in the same run, under the same load.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
DEFAULTS = ["model.d_model=2048", "model.n_heads=16", "model.n_layers=2", "model.seq_len=128"]


def best_of(fn: Callable[[], Any], repeats: int) -> float:
    """Fastest of `repeats` timed calls, after one untimed (first touch, compilation)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def numpy_bandwidths(n: int, repeats: int) -> dict[str, float]:
    """Bytes/s of numpy's copy (one thread, and every core) and triad over float32 arrays of `n` elements."""
    import numpy as np

    src, dst, c = np.ones(n, np.float32), np.zeros(n, np.float32), np.full(n, 2.0, np.float32)
    nbytes = src.nbytes
    out = {"numpy_copy_1_thread": 2 * nbytes / best_of(lambda: np.copyto(dst, src), repeats)}
    cores = len(os.sched_getaffinity(0))
    bounds = np.linspace(0, n, cores + 1, dtype=np.int64)

    def threaded_copy() -> None:
        threads = [threading.Thread(target=np.copyto, args=(dst[a:b], src[a:b])) for a, b in zip(bounds, bounds[1:])]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    out[f"numpy_copy_{cores}_threads"] = 2 * nbytes / best_of(threaded_copy, repeats)

    def numpy_triad() -> None:
        np.multiply(c, np.float32(3.0), out=dst)
        np.add(dst, src, out=dst)

    out["numpy_triad"] = 5 * nbytes / best_of(numpy_triad, repeats)
    return out


def xla_bandwidth(n: int, repeats: int) -> float:
    """Bytes/s of a triad b + 3c on the XLA CPU backend, b donated (updated in place), over `n` float32s."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    cpu = jax.local_devices(backend="cpu")[0]  # the host updates' backend, also on a GPU machine
    triad = jax.jit(lambda b, c: b + jnp.float32(3.0) * c, donate_argnums=0)
    state = {"b": jax.device_put(np.ones((n,), np.float32), cpu)}
    c = jax.device_put(np.full((n,), 2.0, np.float32), cpu)

    def run() -> None:
        state["b"] = triad(state["b"], c).block_until_ready()

    return 3 * 4 * n / best_of(run, repeats)


def bandwidths(gib: float, repeats: int) -> dict[str, float]:
    """GB/s (1e9 bytes read + written per second) of each way of moving `gib` GiB arrays."""
    n = int(gib * 2**30) // 4
    out = {**numpy_bandwidths(n, repeats), "xla_triad": xla_bandwidth(n, repeats)}
    return {k: round(v / 1e9, 3) for k, v in out.items()}


def time_update(config: str, overrides: list[str], repeats: int, leafwise: bool = False) -> dict[str, Any]:
    """The engine's host stage update of one block: seconds per call, bytes it must move, CPU time / wall.
    `leafwise`: the leaf-wise update instead (`make_stage_update` with elementwise=False), jitted as the engine
    jits its updates. `optimizer.host_kernel=false` among the overrides: XLA's flat update, not the kernel."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from angel_jax.config import load_config
    from angel_jax.memory import HostTier
    from angel_jax.memory.malloc import return_large_frees_to_the_os
    from angel_jax.schedule.blueprint import blueprint, params_layout
    from angel_jax.schedule.runtime import placements

    return_large_frees_to_the_os()  # as the paged engine runs
    cfg = load_config(config, overrides)
    block = next(s.name for s in params_layout(cfg).stages if s.name.startswith("block"))
    block_bytes = sum(s.nbytes for s in params_layout(cfg).stage(block).slots)
    cfg = dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, page_size=block_bytes))
    bp = blueprint(cfg)
    stage = next(s for s in bp.staged.stages if s.name == block)
    pl, ol = bp.params_layout.stage(block), bp.opt_layout.stage(block)
    device = jax.devices()[0]
    place = placements(device, HostTier(device, budget=None).sharding)["host"]
    updates = bp.updates
    if leafwise:
        from angel_jax.optim import make_optimizer
        from angel_jax.optim.stage_update import make_stage_update
        from angel_jax.schedule.updater import StageUpdates

        tx, _ = make_optimizer(cfg.optimizer, cfg.train.steps, clip=False)  # as blueprint() makes it
        pure = make_stage_update(tx, pl, ol, bp.opt_structure[block], cfg.optimizer.grad_clip)
        updates = StageUpdates({stage.kind: pure}, {})
    fn = updates.get(stage.kind, place.compute, donate_params=True)

    def pages(layout: Any, value: float) -> tuple:
        # (pages are held as the bits of their values, memory/layout.py)
        return tuple(jax.device_put(np.full((p.length,), value, p.dtype).view(p.bits), place.compute)
                     for p in layout.pages)

    def setup() -> tuple:
        return jax.block_until_ready((pages(pl, 0.01), pages(pl, 0.001), pages(ol, 0.0001),
                                      jax.device_put(bp.opt_small[block], place.compute),
                                      jax.device_put(jnp.ones((), jnp.float32), place.compute),
                                      jax.device_put(jnp.bool_(True), place.compute),
                                      jax.device_put(jnp.float32(1.0), place.compute)))

    args = setup()
    compiled = fn.lower(*args).compile()
    hlo = compiled.as_text()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    # How many parts XLA splits each large loop of the update into, to run them on its thread pool at once.
    partitions = max((int(n) for n in re.findall(r'"outer_dimension_partitions":\["(\d+)"', hlo)), default=1)
    jax.block_until_ready(fn(*args))  # compile
    wall, cpu, faults = [], 0.0, 0
    for _ in range(repeats):
        args = setup()
        f0, c0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time(), time.perf_counter()
        jax.block_until_ready(fn(*args))
        wall.append(time.perf_counter() - t0)
        cpu += time.process_time() - c0
        faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        del args
    param_bytes = sum(s.nbytes for s in pl.slots)
    opt_bytes = sum(s.nbytes for s in ol.slots)
    moved = 2 * param_bytes + param_bytes + 2 * opt_bytes  # params r+w, grads r, optimizer state r+w
    from angel_jax.optim.kernels import HOST_OPTIMIZER

    return {"stage": block, "update_by": "host kernel" if HOST_OPTIMIZER in hlo else "xla",
            "optimizer": cfg.optimizer.name, "state_dtype": cfg.optimizer.state_dtype,
            "param_dtype": cfg.model.param_dtype, "master_weights": cfg.optimizer.master_weights,
            "params": sum(int(np.prod(s.shape)) for s in pl.slots), "param_bytes": param_bytes,
            "opt_bytes": opt_bytes, "bytes_moved": moved, "update_s": [round(t, 5) for t in wall],
            "update_s_median": round(statistics.median(wall), 5), "update_s_best": round(min(wall), 5),
            "cpu_per_wall": round(cpu / sum(wall), 3), "page_faults_per_call": faults // repeats,
            "xla_loop_partitions": partitions, "xla_bytes_accessed": int(cost.get("bytes accessed", 0)),
            "cores": len(os.sched_getaffinity(0))}


PLAIN_ENV = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}


def child_update(args: argparse.Namespace, env: dict[str, str], one_core: bool, leafwise: bool = False,
                 xla: bool = False) -> dict[str, Any]:
    """`time_update` in a child process started with `env` (glibc reads its tunables at start), optionally pinned
    to one core before JAX starts (XLA sizes its thread pool from the CPUs the process may run on); `xla`: with
    the host kernel off."""
    cmd = [sys.executable, __file__, args.config, *args.overrides, *(["optimizer.host_kernel=false"] if xla else []),
           "--update-only", "--repeats", str(args.repeats)]
    cmd += (["--one-core"] if one_core else []) + (["--leafwise"] if leafwise else [])
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", default=str(ROOT / "experiments" / "gpt_tiny.yaml"))
    p.add_argument("overrides", nargs="*")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--gib", type=float, default=1.0, help="size of each array the bound is measured on")
    p.add_argument("--write", action="store_true", help="append the figures to experiments/results/")
    p.add_argument("--update-only", action="store_true", help=argparse.SUPPRESS)  # a child: time the update
    p.add_argument("--bandwidth-only", action="store_true", help=argparse.SUPPRESS)  # a child: measure the bound
    p.add_argument("--one-core", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--leafwise", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if "=" in args.config:  # overrides alone: the default config
        args.config, args.overrides = p.get_default("config"), [args.config, *args.overrides]
    overrides = DEFAULTS + args.overrides
    if args.bandwidth_only:
        print(json.dumps(bandwidths(args.gib, args.repeats)))
        return 0
    if args.update_only:
        if args.one_core:
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        print(json.dumps(time_update(args.config, overrides, args.repeats, args.leafwise)))
        return 0

    from angel_jax.benchinfo import emit, results_path
    from angel_jax.memory.malloc import with_huge_pages

    out = results_path("host_optimizer") if args.write else None
    huge = with_huge_pages(PLAIN_ENV)
    # The bound is measured as the update is timed: in a child started with malloc's huge pages (without them the
    # same copies and triads ran at 0.6-1.0x these figures here, depending on how the arrays happened to be mapped).
    done = subprocess.run([sys.executable, __file__, "--bandwidth-only", "--gib", str(args.gib), "--repeats",
                           str(args.repeats)], cwd=ROOT, env=huge, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"measuring the bandwidth bound failed ({done.returncode}):\n{done.stderr[-3000:]}")
    bw = json.loads(done.stdout.strip().splitlines()[-1])
    bound = max(bw.values())
    common = {"bench": "host_optimizer", "config": Path(args.config).stem, "overrides": overrides}
    emit({**common, "figure": "bandwidth", "gib": args.gib, "gbs": bw, "bound_gbs": bound,
          "bound_from": max(bw, key=bw.get)}, out)

    runs = {name: child_update(args, env, one_core, leafwise, xla) for name, env, one_core, leafwise, xla in (
        ("huge_pages", huge, False, False, False), ("plain", PLAIN_ENV, False, False, False),
        ("one_core", huge, True, False, False), ("xla", huge, False, False, True),
        ("leafwise", huge, False, True, True))}
    upd, plain, one, leaf, xla = runs["huge_pages"], runs["plain"], runs["one_core"], runs["leafwise"], runs["xla"]
    achieved = upd["bytes_moved"] / upd["update_s_median"] / 1e9
    # XLA's cost analysis describes an update XLA compiled; of the kernel (a custom call) it knows nothing.
    of_xla = upd.pop("xla_bytes_accessed"), upd.pop("xla_loop_partitions")
    traffic = {} if upd["update_by"] != "xla" else {
        "xla_bytes_accessed": of_xla[0], "xla_loop_partitions": of_xla[1],
        "xla_bytes_per_byte_needed": round(of_xla[0] / upd["bytes_moved"], 3),
        "xla_traffic_gbs": round(of_xla[0] / upd["update_s_median"] / 1e9, 3)}
    emit({**common, "figure": "update", "env": "GLIBC_TUNABLES=" + huge["GLIBC_TUNABLES"],
          **upd, "achieved_gbs": round(achieved, 3), "bound_gbs": bound, "ratio": round(achieved / bound, 4),
          "goal": 0.70, "meets_goal": achieved / bound >= 0.70, "multi_core": upd["cpu_per_wall"] > 1.2, **traffic,
          "without_huge_pages_s": plain["update_s_median"],
          "without_huge_pages_faults_per_call": plain["page_faults_per_call"],
          "speedup_huge_pages": round(plain["update_s_median"] / upd["update_s_median"], 3),
          "one_core_s": one["update_s_median"], "one_core_cpu_per_wall": one["cpu_per_wall"],
          "speedup_all_cores": round(one["update_s_median"] / upd["update_s_median"], 3),
          "xla_flat_s": xla["update_s_median"], "xla_flat_cpu_per_wall": xla["cpu_per_wall"],
          "xla_flat_loop_partitions": xla["xla_loop_partitions"],
          "xla_flat_bytes_per_byte_needed": round(xla["xla_bytes_accessed"] / xla["bytes_moved"], 3),
          "speedup_kernel": round(xla["update_s_median"] / upd["update_s_median"], 3),
          "leafwise_s": leaf["update_s_median"],
          "leafwise_xla_bytes_per_byte_needed": round(leaf["xla_bytes_accessed"] / leaf["bytes_moved"], 3),
          "speedup_flat": round(leaf["update_s_median"] / xla["update_s_median"], 3)}, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
