"""Run by test_fsdp.py as two real processes of one CPU device each (jax.distributed, gloo collectives): the
in-memory engine with mesh.fsdp 2, its state sharded across the processes.

    python fsdp_mp_check.py PORT PROCESS_ID DIRECTORY

Each process feeds its rows of every global batch, then checkpoints its own pieces of the state through the
trainer's checkpointer (per process, in DIRECTORY/run) and restores them. Process 0 prints one JSON line: the
losses, the bytes of the state on its device (measured from the live shards), the bytes of its snapshot against
the state's, whether the snapshot loads back bit for bit directly and through the checkpoint, and the step and tier
restored. Process 0 also leaves the whole state (gathered from both processes) in DIRECTORY/whole.npz, for
test_fsdp.py to compare with the pieces of both processes assembled."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
# (as the four-device check whose reference losses these are compared with: without LLVM's optimisations)
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))]

import jax  # noqa: E402
import numpy as np  # noqa: E402

from angel_jax.config import MeshConfig  # noqa: E402
from angel_jax.train.checkpointing import TrainCheckpointer  # noqa: E402
from angel_jax.train.engines import InMemoryEngine  # noqa: E402
from angel_jax.train.protocol import named_leaves  # noqa: E402
from angel_jax.train.sharding import device_bytes, make_mesh, whole  # noqa: E402
from test_fsdp import BATCH, MODEL, STEPS, cfg  # noqa: E402
from test_paged import batches  # noqa: E402


def main(port: int, process_id: int, directory: Path) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    assert jax.device_count() == 2 and jax.local_device_count() == 1
    engine = InMemoryEngine(cfg(), make_mesh(MeshConfig(fsdp=2), jax.devices()))
    rows = slice(process_id * BATCH // 2, (process_id + 1) * BATCH // 2)

    def global_batch(b: jax.Array) -> jax.Array:
        return jax.make_array_from_process_local_data(engine.batch_sharding, np.asarray(b)[rows])

    out = {"bytes": list(device_bytes(engine.state).values())}
    out["losses"] = [float(engine.step(global_batch(b))["loss"]) for b in batches(STEPS, MODEL, BATCH)]
    # A checkpoint's view of the state: this process's pieces of every leaf, loaded back into the sharded engine.
    out["per_process"] = engine.checkpoints_per_process
    snapshot = engine.state_snapshot()
    arrays = {k: np.array(v) for k, v in snapshot.arrays.items()}
    snapshot.release()
    out["snapshot_bytes"] = sum(a.nbytes for a in arrays.values())
    out["state_bytes"] = sum(a.nbytes for a in named_leaves(engine.state).values())
    out["sharded_leaves"] = sum(not a.is_fully_addressable for a in jax.tree.leaves(engine.state))
    meta = engine.state_meta()
    engine.load_state(arrays, meta)
    out["round_trip"] = same(arrays, engine)
    # Through the trainer's checkpointer: each process writes its pieces in its own tiers, both restore them.
    c = dataclasses.replace(cfg(), checkpoint=dataclasses.replace(cfg().checkpoint, memory_dir=str(directory / "mem")))
    run_dir = directory / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    saving = TrainCheckpointer(c, run_dir, primary=process_id == 0, per_process=engine.checkpoints_per_process)
    saving.save(STEPS, engine.state_snapshot(), {"engine": meta})
    saving.close()
    restoring = TrainCheckpointer(c, run_dir, primary=process_id == 0, per_process=engine.checkpoints_per_process)
    step, restored, restored_meta, tier = restoring.restore_latest()
    restoring.close()
    engine.load_state(restored, restored_meta["engine"])
    out.update(step=step, tier=tier, restored_bit_exact=same(arrays, engine))
    whole_state = {k: np.asarray(whole(a)) for k, a in named_leaves(engine.state).items()}  # a collective
    engine.close()
    if process_id == 0:
        np.savez(directory / "whole.npz", **{k.replace("/", "|"): v for k, v in whole_state.items()})
        print(json.dumps(out), flush=True)
    jax.distributed.shutdown()


def same(arrays: dict, engine: InMemoryEngine) -> bool:
    again = {k: np.array(v) for k, v in engine.state_snapshot(may_hold=False).arrays.items()}
    return sorted(arrays) == sorted(again) and all(np.array_equal(arrays[k], again[k]) for k in arrays)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
