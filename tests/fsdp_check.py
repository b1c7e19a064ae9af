"""Run by test_fsdp.py in its own process with four CPU devices: the in-memory engine with its state sharded over
'fsdp' (and over 'data' x 'fsdp') against one device, the bytes each device holds, a checkpoint round trip.

Prints one JSON line: losses per layout, per-device state bytes (measured from the live shards), the checkpoint
round trip's verdicts."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

# (Without LLVM's optimisations the programs compile in about half the time; every comparison here is between runs
# compiled alike.)
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
                           " --xla_backend_optimization_level=0")
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))]

import jax  # noqa: E402
import numpy as np  # noqa: E402

from angel_jax.config import MeshConfig  # noqa: E402
from angel_jax.errors import AngelError  # noqa: E402
from angel_jax.train.checkpointing import TrainCheckpointer  # noqa: E402
from angel_jax.train.engines import InMemoryEngine, build_engine  # noqa: E402
from angel_jax.train.protocol import named_leaves  # noqa: E402
from angel_jax.train.sharding import device_bytes, make_mesh  # noqa: E402
from test_fsdp import BATCH, MODEL, SAVE_AT, STEPS, cfg  # noqa: E402
from test_paged import batches  # noqa: E402


def run(engine: InMemoryEngine, data: list, first: int = 0) -> list[float]:
    return [float(engine.step(jax.device_put(b, engine.batch_sharding))["loss"]) for b in data[first:]]


def host_state(engine: InMemoryEngine) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in named_leaves(engine.state).items()}


def main() -> None:
    data = batches(STEPS, MODEL, BATCH)
    out: dict = {"losses": {}, "bytes": {}}
    # The reference: one device, the whole state on it (what each device holds when the state is replicated).
    single = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1], axis_types=(jax.sharding.AxisType.Auto,))
    engine = InMemoryEngine(cfg(), single)
    out["bytes"]["single"] = list(device_bytes(engine.state).values())
    out["losses"]["single"] = run(engine, data)
    engine.close()
    # data 2 x fsdp 2, with gradient accumulation: 2 micro-batches of one row per device.
    engine = InMemoryEngine(cfg(micro=1), make_mesh(MeshConfig(data=2, fsdp=2), jax.devices()))
    out["bytes"]["data2xfsdp2"] = sorted(device_bytes(engine.state).values())
    out["losses"]["data2xfsdp2-micro1"] = run(engine, data)
    engine.close()
    out["checkpoint"] = fsdp4_with_a_checkpoint(data, out)
    paged = dataclasses.replace(cfg(), memory=dataclasses.replace(cfg().memory, mode="paged"))
    try:
        build_engine(paged, make_mesh(MeshConfig(data=2, fsdp=2), jax.devices()))  # ZeRO-3 shards over all
    except AngelError as e:
        out["paged_refused"] = str(e)
    print(json.dumps(out))


def fsdp4_with_a_checkpoint(data: list, out: dict) -> dict:
    """fsdp 4 for STEPS steps, its state saved at step SAVE_AT through the trainer's checkpointer (memory tier,
    orbax in the background) and loaded into a fresh sharded engine: the same arrays bit for bit, laid out as
    the engine lays them out, and the same remaining steps."""
    mesh = make_mesh(MeshConfig(fsdp=4), jax.devices())
    engine = InMemoryEngine(cfg(), mesh)
    out["bytes"]["fsdp4"] = sorted(device_bytes(engine.state).values())
    losses = run(engine, data[:SAVE_AT])
    saved = host_state(engine)
    with tempfile.TemporaryDirectory() as tmp:
        c = dataclasses.replace(cfg(), checkpoint=dataclasses.replace(cfg().checkpoint, memory_dir=f"{tmp}/mem"))
        (Path(tmp) / "run").mkdir()
        checkpointer = TrainCheckpointer(c, Path(tmp) / "run", primary=True)
        checkpointer.save(SAVE_AT, engine.state_snapshot(), {"engine": engine.state_meta()})
        out["losses"]["fsdp4"] = losses + run(engine, data, SAVE_AT)
        out["bytes"]["fsdp4-after"] = sorted(device_bytes(engine.state).values())
        engine.close()
        checkpointer.wait()
        step, arrays, meta, tier = checkpointer.restore_latest()
        checkpointer.close()
    resumed = InMemoryEngine(cfg(), mesh)
    resumed.load_state(arrays, meta["engine"])
    restored = host_state(resumed)
    result = {
        "step": step, "tier": tier, "leaves": len(restored),
        "bit_exact": sorted(saved) == sorted(restored) and all(
            np.array_equal(saved[k], restored[k]) and saved[k].dtype == restored[k].dtype for k in saved),
        "sharded_leaves": sum(not a.sharding.is_fully_replicated for a in jax.tree.leaves(resumed.state)),
        "laid_out": all(a.sharding == s for a, s in zip(jax.tree.leaves(resumed.state),
                                                         jax.tree.leaves(resumed.shardings))),
        "resumed": run(resumed, data, SAVE_AT)}
    resumed.close()
    return result


if __name__ == "__main__":
    main()
