"""Run by test_zero_checkpoint.py in its own process with four CPU devices: checkpoints of the sharded (ZeRO-3)
paged engine through the trainer's checkpointer (real orbax).

- 4 ranks, saved at step SAVE_AT and restored into 4 ranks: the restored state equals the saved one bit for bit
  and the remaining steps give the uninterrupted run's losses exactly.
- Resharded resumes from the persistent tier, each saving its own checkpoint at once for the next:
  4 -> 2 -> 4 ranks. Each resumed run's losses are compared with the uninterrupted run's (another reduction
  order: close, not equal); resharding only moves bytes, so the state back on 4 ranks equals the state saved on
  4 ranks bit for bit.
- A checkpoint whose page layout is not this model's is refused with a message naming the difference.

Prints one JSON line."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

# Without LLVM's optimisations the engine's few dozen programs compile in half the time; every comparison here is
# between runs compiled alike. (Run as a script: zero_ckpt_mp_check.py imports this module for its configuration.)
FAST_COMPILE = " --xla_backend_optimization_level=0"
if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
                               + FAST_COMPILE)
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))]

import jax  # noqa: E402
import numpy as np  # noqa: E402

from angel_jax.config import MeshConfig, ModelConfig, dump_yaml  # noqa: E402
from angel_jax.train.checkpointing import TrainCheckpointer  # noqa: E402
from angel_jax.train.engines import build_engine  # noqa: E402
from angel_jax.train.protocol import StateMismatch  # noqa: E402
from angel_jax.train.sharding import make_mesh  # noqa: E402
from angel_jax.train.weights import load_params  # noqa: E402
import test_paged as tp  # noqa: E402

MODEL = ModelConfig(d_model=32, n_layers=2, n_heads=2, seq_len=8, compute_dtype="float32")
STEPS, SAVE_AT, BATCH = 6, 3, 4
RANKS = 4  # the uninterrupted run's (and the world size a resharded run comes back to)
PAGE = 8 * 4096 // 4
# Per device: the working set and part of the state (505 kB in all): over 2 ranks some stages stream, over 4 none.
DEVICE_BUDGET = 500_000  # each rank's page: several pages per stage, so leaves span pages and pages hold several leaves


def cfg(tmp: Path, name: str, page: int = PAGE, peer: bool = False):
    base = tp._cfg(steps=STEPS, model=MODEL)
    memory = dataclasses.replace(base.memory, page_size=page, device_budget=DEVICE_BUDGET)
    checkpoint = dataclasses.replace(base.checkpoint, memory_dir=str(tmp / f"{name}-mem"),
                                     peer_dir=str(tmp / f"{name}-peer") if peer else base.checkpoint.peer_dir)
    return dataclasses.replace(base, memory=memory, checkpoint=checkpoint,
                               train=dataclasses.replace(base.train, batch_size=BATCH, run_dir=str(tmp / name)))


def engine(c, ranks: int):
    t = time.time()
    e = build_engine(c, make_mesh(MeshConfig(fsdp=ranks), jax.devices()[:ranks]))
    BUILD.append(round(time.time() - t, 1))
    STREAMED[ranks] = len(e.built.plan.streamed)
    return e


STREAMED: dict[int, int] = {}
BUILD: list[float] = []


def run(e, data: list) -> list[float]:
    return [float(e.step(jax.device_put(b, e.batch_sharding))["loss"]) for b in data]


def state(e) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in e.state_snapshot().arrays.items()}


def same(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)


def save(c, e, step: int) -> None:
    run_dir = c.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    checkpointer = TrainCheckpointer(c, run_dir, primary=True)
    checkpointer.save(step, e.state_snapshot(), {"engine": e.state_meta()})
    checkpointer.wait()
    checkpointer.close()


def restore(c, persistent_only: bool) -> tuple:
    if persistent_only:  # the memory tier gone (another host, or a reboot): the orbax copy
        shutil.rmtree(c.checkpoint.memory_dir)
    run_dir = c.run_dir
    checkpointer = TrainCheckpointer(c, run_dir, primary=True)
    step, arrays, meta, tier = checkpointer.restore_latest()
    arrays = {k: np.asarray(v) for k, v in arrays.items()}
    checkpointer.close()
    return step, arrays, meta, tier


def refused(e, arrays: dict, meta: dict) -> str:
    """The checkpoint's meta with one page fewer in its first stage's parameters (as another model's would be):
    load_state must refuse it rather than reshard pages it does not understand."""
    layout = json.loads(json.dumps(meta["layout"]))
    first = next(iter(layout))
    layout[first]["params"] = layout[first]["params"][:-1]
    try:
        e.load_state(arrays, dict(meta, layout=layout))
    except StateMismatch as err:
        return str(err)
    return "accepted"


def resume_shards(directory: Path, data: list) -> dict:
    """Once zero_ckpt_mp_check.py's two processes are done: their run's checkpoint (each process's shards in its
    own directories) resumed here, one process over two devices, assembled from the persistent tiers."""
    deadline = time.time() + 200
    while not all((directory / f"mp-done-{p}").is_file() for p in (0, 1)):
        if time.time() > deadline:
            return {"error": "the two-process run did not finish"}
        time.sleep(0.2)
    c = cfg(directory, "mp", peer=True)  # the two processes' config
    e = engine(c, 2)
    checkpointer = TrainCheckpointer(c, c.run_dir, primary=True)
    # An older whole-state checkpoint beside the shards (as a run over one process before them would leave): the
    # newest step wins, whatever its kind.
    checkpointer.save(SAVE_AT - 1, e.state_snapshot(), {"engine": e.state_meta()})
    checkpointer.wait()
    step, arrays, meta, tier = checkpointer.restore_latest()
    checkpointer.close()
    e.load_state(arrays, meta["engine"])
    held = jax.tree.map(np.asarray, e.params())
    # The weights reader (export, sample) on the same run: the parameters assembled from both processes' shards.
    (c.run_dir / "config.yaml").write_text(dump_yaml(c))
    loaded = load_params(c.run_dir)
    out = {"step": step, "tier": tier, "losses": run(e, data[SAVE_AT:]),
           "theirs": json.loads((directory / "mp-done-0").read_text()), "weights_step": loaded.step,
           "weights_bit_exact": jax.tree.structure(loaded.params) == jax.tree.structure(held) and all(
               np.array_equal(a, b) for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(held)))}
    e.close()
    return out


def main(shards_of: Path | None = None) -> None:
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("angel_jax.train.paged").setLevel(logging.INFO)
    t0 = time.time()
    data = tp.batches(STEPS, MODEL, BATCH)
    out: dict = {"losses": {}, "resumes": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        c2 = cfg(tmp, "r4")
        e = engine(c2, RANKS)
        losses = run(e, data[:SAVE_AT])
        saved = state(e)
        save(c2, e, SAVE_AT)
        if shards_of is not None:  # the checkpoint zero_ckpt_mp_check.py's two processes resume over 2 ranks
            shutil.copytree(c2.run_dir, shards_of / "other-world")
            (shards_of / "other-world-saved").touch()
        whole = jax.tree.map(np.asarray, e.params())
        out["losses"]["uninterrupted"] = losses + run(e, data[SAVE_AT:])
        e.close()
        # The weights reader (export, sample): the parameters of a checkpoint written over 4 ranks, bit for bit.
        (c2.run_dir / "config.yaml").write_text(dump_yaml(c2))
        loaded = load_params(c2.run_dir).params
        out["weights_bit_exact"] = jax.tree.structure(loaded) == jax.tree.structure(whole) and all(
            np.array_equal(a, b) for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(whole)))
        # Same world size: memory tier, bit for bit.
        step, arrays, meta, tier = restore(c2, persistent_only=False)
        e = engine(c2, RANKS)
        e.load_state(arrays, meta["engine"])
        out["same"] = {"step": step, "tier": tier, "ranks": meta["engine"].get("ranks"),
                       "bit_exact": same(saved, state(e)), "losses": run(e, data[SAVE_AT:])}
        e.close()
        # Other world sizes, from the persistent tier: 4 -> 2 -> 4.
        prev = c2
        for i, ranks in enumerate((2, RANKS)):
            step, arrays, meta, tier = restore(prev, persistent_only=True)
            c = cfg(tmp, f"resume{i}-{ranks}")
            e = engine(c, ranks)
            if i == 0:
                out["other_layout"] = refused(e, arrays, meta["engine"])
            e.load_state(arrays, meta["engine"])
            del arrays
            back = state(e)
            if i == 0:  # the next resume's checkpoint
                save(c, e, step)
            out["resumes"].append({"from": meta["engine"].get("ranks", 1), "to": ranks, "step": step, "tier": tier,
                                   "bit_exact_with_saved": same(saved, back) if ranks == RANKS else None,
                                   "losses": run(e, data[SAVE_AT:])})
            e.close()
            prev = c
        if shards_of is not None:
            out["assembled"] = resume_shards(shards_of, data)
    out["streamed"] = STREAMED
    out["build_seconds"] = BUILD
    out["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else None)
