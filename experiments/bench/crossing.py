"""Ways pages can move between an accelerator's memories and the XLA CPU backend (where host updates run).

    PYTHONPATH=. python experiments/bench/crossing.py [--mib 256] [--write]

On an accelerator the host tier is the accelerator client's pinned host memory and host updates compute on the
XLA CPU backend: a second client. `angel_jax/memory/crossing.py` chose its paths from these figures. Each figure
moves one float32 array of --mib MiB (median of 5 after a warm-up); GB/s counts the array's bytes once:

  np.asarray(pinned)           numpy view of a pinned page (zero-copy when the view aliases it)
  device_put(pinned->cpu)      the generic cross-client path, and every other device_put pair between pinned
                               host memory, device memory, the CPU backend and numpy
  dlpack(pinned)->cpu          jax.dlpack.from_dlpack onto the CPU backend; `zero_copy`: same address
  compute_on(device_host)      a triad x*0.9 + y*0.1 on pinned operands inside the accelerator's program
                               (jax.experimental.compute_on), against the same triad on the CPU backend

One JSON line each, appended to experiments/results/crossing_<platform>.jsonl with --write. On the CPU backend
every path stays inside one client (the figures say nothing about an accelerator).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from angel_jax.benchinfo import emit, machine_info, results_path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--write", action="store_true", help="append the figures to experiments/results/")
    args = p.parse_args(argv)
    save, machine = results_path("crossing") if args.write else None, machine_info()
    acc, cpu = jax.devices()[0], jax.local_devices(backend="cpu")[0]
    pinned = SingleDeviceSharding(acc, memory_kind="pinned_host")
    device, compute = SingleDeviceSharding(acc, memory_kind="device"), SingleDeviceSharding(cpu)
    a = np.random.default_rng(0).standard_normal(args.mib * 2**20 // 4, dtype=np.float32)

    def figure(path: str, fn, **extra) -> None:
        try:
            jax.block_until_ready(fn())
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                jax.block_until_ready(fn())
                times.append(time.perf_counter() - t0)
            s = statistics.median(times)
            emit({"bench": "crossing", "path": path, "bytes": a.nbytes, "s": round(s, 6),
                  "GBps": round(a.nbytes / max(s, 1e-9) / 1e9, 2), **extra}, save, machine)
        except Exception as e:  # noqa: BLE001 - a path this jaxlib lacks is a result too
            emit({"bench": "crossing", "path": path, "error": repr(e)[:300]}, save, machine)

    xp, xc, xd = (jax.block_until_ready(jax.device_put(a, s)) for s in (pinned, compute, device))
    view = np.asarray(xp)
    figure("np.asarray(pinned)", lambda: np.asarray(xp),
           zero_copy=view.__array_interface__["data"][0] == xp.unsafe_buffer_pointer())
    for name, src, dst in [("pinned->cpu", xp, compute), ("cpu->pinned", xc, pinned), ("numpy->pinned", a, pinned),
                           ("numpy->cpu", a, compute), ("cpu->device", xc, device), ("device->cpu", xd, compute),
                           ("pinned->device", xp, device), ("device->pinned", xd, pinned)]:
        figure(f"device_put({name})", lambda src=src, dst=dst: jax.device_put(src, dst))
    try:
        alias = jax.dlpack.from_dlpack(xp, device=cpu)
        figure("dlpack(pinned)->cpu", lambda: jax.dlpack.from_dlpack(xp, device=cpu),
               zero_copy=alias.unsafe_buffer_pointer() == xp.unsafe_buffer_pointer())
    except Exception as e:  # noqa: BLE001
        emit({"bench": "crossing", "path": "dlpack(pinned)->cpu", "error": repr(e)[:300]}, save, machine)
    try:
        from jax.experimental.compute_on import compute_on

        triad = compute_on(compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)(
            lambda x, y: x * 0.9 + y * 0.1)
        on_pinned = jax.jit(triad, out_shardings=pinned)
        yp = jax.device_put(a, pinned)
        figure("compute_on(device_host) triad, 3 arrays", lambda: on_pinned(xp, yp))
    except Exception as e:  # noqa: BLE001
        emit({"bench": "crossing", "path": "compute_on(device_host) triad, 3 arrays", "error": repr(e)[:300]},
             save, machine)
    on_cpu = jax.jit(lambda x, y: x * 0.9 + y * 0.1)
    yc = jax.device_put(a, compute)
    figure("cpu-backend triad, 3 arrays", lambda: on_cpu(xc, yc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
