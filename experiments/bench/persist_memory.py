"""The memory a persistent save needs beside the snapshot it persists: the persistent tier's writer against orbax's
stock numpy handler, from the same memory-tier snapshot to the same directory.

    python experiments/bench/persist_memory.py [--arrays 16] [--mib 64] [--repeats 3] [--workdir DIR] [--write]
                                               [--snapshot MEMORY_TIER/step_K]

The persistent tier copies a committed memory-tier snapshot (read-only views of its file in /dev/shm) into an
orbax checkpoint. Orbax's stock numpy handler (`StandardSave`) first copies every array into the process's memory,
as a guard against arrays changed while they are written, and compresses each (zstd), which holds the compressed
copy in memory until it is written; the tier's writer (angel_jax/checkpoint/orbax_local.py) writes from the views,
which nothing changes, uncompressed. Each save runs in a fresh child process; a thread there samples its anonymous
resident memory (`RssAnon`: what the process allocated, not the mapped snapshot's pages) every 5 ms.

The state is random float32 (`--arrays` x `--mib`, incompressible), or with `--snapshot` a committed memory-tier
snapshot of a real run (e.g. /dev/shm/angel_jax-0/<run>/step_600 after `make train`), whose bytes on disk show what
compression gains on trained weights and optimizer state.

Figures (one JSON line each, appended to experiments/results/persist_memory_<platform>.jsonl with --write):

  persist_extra_anon_<writer>       peak RssAnon during the save minus RssAnon before it, bytes (median)
  persist_s_<writer>                the save's wall time (median)
  persist_extra_anon_per_state_<writer>   the first over the state's bytes
  persist_disk_per_state_<writer>   the checkpoint's bytes on disk over the state's bytes
with <writer> 'stock_orbax' or 'angel_jax'. Writers alternate, so the machine's load moves both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from angel_jax.benchinfo import emit, machine_info, results_path

WRITERS = ("stock_orbax", "angel_jax")


def _rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def child(writer: str, snapshot: Path, target: Path) -> None:
    """One save of the committed snapshot at `snapshot` into `target` (a fresh orbax checkpoint directory);
    prints {"extra_anon": bytes, "seconds": s}."""
    import orbax.checkpoint as ocp

    from angel_jax.checkpoint import snapshot as snap
    from angel_jax.checkpoint.persist import OrbaxTier
    from angel_jax.checkpoint.tiers import Committed

    index, views = snap.open_arrays(snapshot, private=False)
    ocp.Checkpointer(ocp.CompositeCheckpointHandler())  # orbax's imports and first-use set-up, outside the window
    base = peak = _rss_anon()
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _rss_anon())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    if writer == "angel_jax":
        OrbaxTier(target.parent, keep_last=1).copy_from(Committed(index.step, snapshot, index))
    else:
        state = {a.name: views[a.name] for a in index.arrays if a.nbytes}
        ocp.Checkpointer(ocp.CompositeCheckpointHandler()).save(
            target.parent / str(index.step), args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                                      meta=ocp.args.JsonSave(index.to_json())))
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    peak = max(peak, _rss_anon())
    print(json.dumps({"extra_anon": peak - base, "seconds": seconds, "disk": snap.dir_bytes(target.parent)}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arrays", type=int, default=16)
    p.add_argument("--mib", type=int, default=64, help="MiB per array")
    p.add_argument("--repeats", type=int, default=3, help="saves per writer (median reported)")
    p.add_argument("--workdir", type=Path, default=None, help="the persistent directories' parent (default: /var/tmp)")
    p.add_argument("--write", action="store_true", help="append the figures to experiments/results/")
    p.add_argument("--snapshot", type=Path, default=None, help="a committed memory-tier snapshot to persist instead")
    p.add_argument("--child", nargs=3, metavar=("WRITER", "SNAPSHOT", "TARGET"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.child[0], Path(args.child[1]), Path(args.child[2]))
        return 0

    from angel_jax.checkpoint import CheckpointManager, CheckpointOptions

    results = results_path("persist_memory") if args.write else None
    machine = machine_info()
    work = Path(tempfile.mkdtemp(prefix="angel_jax_persist_bench_", dir=args.workdir or "/var/tmp"))
    memory = Path("/dev/shm") / f"angel_jax_persist_bench_{os.getpid()}"
    try:
        if args.snapshot is None:  # random float32: a memory-tier snapshot of it (its persistent copy unmeasured)
            rng = np.random.default_rng(0)
            n = args.mib * (1 << 20) // 4
            state = {f"layer{i:02d}/w": rng.random(n, dtype=np.float32) for i in range(args.arrays)}
            with CheckpointManager(CheckpointOptions(persistent_dir=work / "engine", memory_dir=memory)) as engine:
                engine.save(1, state, {"step": 1})
            del state
        snapshot = args.snapshot or memory / "step_1"
        from angel_jax.checkpoint import snapshot as snap

        index = snap.read_index(snapshot)
        nbytes = sum(a.nbytes for a in index.arrays)
        samples: dict[str, list[dict]] = {w: [] for w in WRITERS}
        for r in range(args.repeats):
            for writer in WRITERS:
                target = work / f"{writer}_{r}" / str(index.step)
                out = subprocess.run([sys.executable, __file__, "--child", writer, str(snapshot), str(target)],
                                     check=True, capture_output=True, text=True)
                samples[writer].append(json.loads(out.stdout.strip().splitlines()[-1]))
                shutil.rmtree(target.parent)
        common = {"state_bytes": nbytes, "arrays": len(index.arrays), "repeats": args.repeats,
                  "state": "random float32" if args.snapshot is None else f"snapshot {args.snapshot}"}
        for writer in WRITERS:
            extra = [s["extra_anon"] for s in samples[writer]]
            seconds = [round(s["seconds"], 3) for s in samples[writer]]
            for name, values, unit in ((f"persist_extra_anon_{writer}", extra, "bytes"),
                                       (f"persist_extra_anon_per_state_{writer}", [round(x / nbytes, 4) for x in extra],
                                        "ratio"),
                                       (f"persist_s_{writer}", seconds, "s"),
                                       (f"persist_disk_per_state_{writer}",
                                        [round(s["disk"] / nbytes, 4) for s in samples[writer]], "ratio")):
                emit({"bench": "persist_memory", "figure": name, "value": statistics.median(values), "unit": unit,
                      **common, "loadavg_1m": os.getloadavg()[0], "samples": values}, results, machine)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(memory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
