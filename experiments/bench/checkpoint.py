"""Training stall per save and restore time: the TCE checkpoint manager against plain blocking orbax.

    python experiments/bench/checkpoint.py [--arrays 16] [--mib 64] [--repeats 3] [--workdir DIR] [--write]

State: `arrays` float32 arrays of `mib` MiB each (default 1 GiB), random (incompressible) values.
Figures (one JSON line each, appended to experiments/results/checkpoint_<platform>.jsonl with --write):

  save_blocking_orbax_s      orbax Checkpointer.save of the state to the persistent directory, blocking (median)
  save_stall_held_s          what the in-memory trainer blocks for: CheckpointManager.save of a held StateSnapshot of
                             the state as jax arrays (references handed over; the copy runs in the background) (median)
  held_copy_s                the background copy of a held save into the memory tier (median)
  save_stall_ratio           save_stall_held_s / save_blocking_orbax_s (target <= 0.05)
  save_stall_engine_first_s  save() of a state that is not held (numpy state updated in place, as host pages are) blocks for the
                             copy into the memory tier: the first save (fresh tmpfs files)
  save_stall_engine_s        the same for later saves, which reuse the evicted snapshot's file (median)
  save_stall_copy_ratio      save_stall_engine_s / save_blocking_orbax_s
  engine_persisted_after_s   from save() to "persisted" in the background (median): the same orbax write
  restore_orbax_s            plain orbax restore of the persisted step, page cache dropped if permitted (median)
  restore_memory_s           CheckpointManager.restore() from the memory tier, XXH3-64 of every array verified:
                             zero-copy (copy-on-write) views of the snapshot file, every byte read (median)
  restore_memory_noverify_s  the same with verify_on_restore=False (maps the file, reads nothing)
  restore_memory_copy_s      verified restore plus a copy of every array into fresh process memory, i.e. the same
                             ownership orbax's result has (median)
  restore_speedup            restore_orbax_s / restore_memory_s (target >= 10)

All save paths write the same bytes to the same directory; the engine's stall is the hand-over of references (held)
or the memcpy into the memory tier (not held); the orbax write happens after save() returns. Saves are spaced by engine.wait() (a save interval longer than
the persist time), so the stall figures do not include contention with a previous save's background work.
Each figure carries the 1-minute load average: on a shared machine the medians move with it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from angel_jax.benchinfo import emit, machine_info, results_path
from angel_jax.checkpoint import CheckpointManager, CheckpointOptions, StateSnapshot


def drop_page_cache() -> bool:
    """Whether the kernel's page cache could be dropped (root in a container usually can)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def orbax_restore(path: Path) -> dict[str, np.ndarray]:
    ckptr = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    return dict(ckptr.restore(path, args=ocp.args.Composite(state=ocp.args.StandardRestore())).state)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arrays", type=int, default=16)
    p.add_argument("--mib", type=int, default=64, help="MiB per array")
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions per figure (median reported)")
    p.add_argument("--workdir", type=Path, default=None, help="persistent directory's parent (default: /var/tmp)")
    p.add_argument("--write", action="store_true", help="append the figures to experiments/results/")
    args = p.parse_args(argv)

    results = results_path("checkpoint") if args.write else None
    machine = machine_info()
    work = Path(tempfile.mkdtemp(prefix="angel_jax_ckpt_bench_", dir=args.workdir or "/var/tmp"))
    memory = Path("/dev/shm") / f"angel_jax_ckpt_bench_{os.getpid()}"
    persistent = work / "persistent"
    rng = np.random.default_rng(0)
    n = args.mib * (1 << 20) // 4
    state = {f"layer{i:02d}/w": rng.random(n, dtype=np.float32) for i in range(args.arrays)}
    nbytes = sum(a.nbytes for a in state.values())
    common = {"state_bytes": nbytes, "arrays": args.arrays, "repeats": args.repeats,
              "persistent_fs": _fs_type(work), "memory_dir": str(memory.parent)}

    def figure(name: str, value: float, unit: str = "s", **extra: object) -> None:
        emit({"bench": "checkpoint", "figure": name, "value": round(value, 4), "unit": unit, **common,
              "loadavg_1m": os.getloadavg()[0], **extra}, results, machine)

    try:
        # ---- blocking orbax baseline: same state, same persistent directory
        blocking = []
        for r in range(args.repeats):
            target = persistent / f"orbax_blocking_{r}"
            t0 = time.perf_counter()
            ocp.Checkpointer(ocp.CompositeCheckpointHandler()).save(
                target, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
            blocking.append(time.perf_counter() - t0)
            shutil.rmtree(target)
        figure("save_blocking_orbax_s", statistics.median(blocking), samples=[round(x, 4) for x in blocking])

        # ---- held saves: the state as jax arrays, each step a new state (no donation while held)
        opts = CheckpointOptions(persistent_dir=persistent / "held", memory_dir=memory / "held", keep_last=2)
        next_state = jax.jit(lambda s, k: {**s, "layer00/w": s["layer00/w"].at[0].set(k)})
        jstate = {k: jnp.array(v, copy=True) for k, v in state.items()}
        held_stalls, copies = [], []
        with CheckpointManager(opts) as engine:
            for step in range(1, args.repeats + 3):
                jstate = jax.block_until_ready(next_state(jstate, step))
                handle = engine.save(step, StateSnapshot(jstate, held=True), {"step": step})
                held_stalls.append(handle.stall_s)
                engine.wait()
                assert handle.state == "persisted", handle
                copies.append(handle.timings["ckpt/copy_s"])
            assert engine.restore().arrays["layer00/w"][0] == step
        del jstate
        figure("save_stall_held_s", statistics.median(held_stalls[2:]), samples=[round(x, 6) for x in held_stalls],
               note="save of a held snapshot of jax arrays: references handed over, copied in the background")
        figure("held_copy_s", statistics.median(copies[2:]), samples=[round(x, 4) for x in copies])
        figure("save_stall_ratio", statistics.median(held_stalls[2:]) / statistics.median(blocking), unit="ratio",
               target="<= 0.05", path="held (the in-memory trainer's saves)")
        shutil.rmtree(memory / "held", ignore_errors=True)
        shutil.rmtree(persistent / "held", ignore_errors=True)

        # ---- engine: first save allocates; later ones reuse the evicted snapshot's file (keep_last=2)
        opts = CheckpointOptions(persistent_dir=persistent, memory_dir=memory, keep_last=2)
        engine = CheckpointManager(opts)
        stalls, persisted = [], []
        for step in range(1, args.repeats + 3):
            state["layer00/w"][0] = step  # a new training state each time (in place, as a trainer would)
            handle = engine.save(step, state, {"step": step})
            engine.wait()
            assert handle.state == "persisted", handle
            stalls.append(handle.stall_s)
            persisted.append(handle.timings["ckpt/total_s"])
        last_step = step
        reused = stalls[2:]
        figure("save_stall_engine_first_s", stalls[0])
        figure("save_stall_engine_s", statistics.median(reused), samples=[round(x, 4) for x in reused],
               note="saves 3.. reuse the file of the snapshot evicted by keep_last=2")
        figure("save_stall_copy_ratio", statistics.median(reused) / statistics.median(blocking), unit="ratio",
               path="copy (host pages updated in place)")
        figure("engine_persisted_after_s", statistics.median(persisted[2:]), samples=[round(x, 4) for x in persisted])

        # ---- restore: orbax from the persistent tier vs the engine from the memory tier
        orbax_times, dropped = [], []
        for _ in range(args.repeats):
            dropped.append(drop_page_cache())
            t0 = time.perf_counter()
            restored = orbax_restore(persistent / str(last_step))
            orbax_times.append(time.perf_counter() - t0)
            assert restored["layer00/w"][0] == last_step
            del restored
        figure("restore_orbax_s", statistics.median(orbax_times), samples=[round(x, 4) for x in orbax_times],
               page_cache_dropped=all(dropped))

        def timed_restore(engine: CheckpointManager, copy: bool) -> float:
            t0 = time.perf_counter()
            r = engine.restore()
            arrays = {k: np.array(v) for k, v in r.arrays.items()} if copy else r.arrays
            elapsed = time.perf_counter() - t0
            assert r.source == "memory" and arrays["layer00/w"][0] == last_step
            return elapsed

        mem_times = [timed_restore(engine, copy=False) for _ in range(args.repeats)]
        copy_times = [timed_restore(engine, copy=True) for _ in range(args.repeats)]
        engine.close()
        with CheckpointManager(CheckpointOptions(persistent_dir=persistent, memory_dir=memory, keep_last=2,
                                                verify_on_restore=False)) as unverified:
            noverify = [timed_restore(unverified, copy=False) for _ in range(args.repeats)]
        figure("restore_memory_s", statistics.median(mem_times), samples=[round(x, 4) for x in mem_times],
               note="XXH3-64 verified; zero-copy copy-on-write views of the /dev/shm snapshot")
        figure("restore_memory_noverify_s", statistics.median(noverify), samples=[round(x, 4) for x in noverify])
        figure("restore_memory_copy_s", statistics.median(copy_times), samples=[round(x, 4) for x in copy_times],
               note="verified, then copied into fresh process memory (first-touch page faults included)")
        figure("restore_speedup", statistics.median(orbax_times) / statistics.median(mem_times), unit="x",
               target=">= 10", page_cache_dropped=all(dropped))
    finally:
        shutil.rmtree(memory, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _fs_type(path: Path) -> str:
    """The file system type of `path` (from /proc/mounts), to say what 'disk' meant."""
    best, fs = "", "unknown"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            _, mount, kind = line.split()[:3]
            if str(path).startswith(mount) and len(mount) > len(best):
                best, fs = mount, kind
    except OSError:
        pass
    return fs


if __name__ == "__main__":
    raise SystemExit(main())
