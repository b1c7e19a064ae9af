"""Run by test_fsdp.py as two real processes of one CPU device each (jax.distributed, gloo collectives): the
in-memory engine with mesh.fsdp 2, its state sharded across the processes.

    python fsdp_mp_check.py PORT PROCESS_ID

Each process feeds its rows of every global batch. Process 0 prints one JSON line: the losses, the bytes of the
state on its device (measured from the live shards), and whether a snapshot (gathered from both processes) loads
back bit for bit."""

from __future__ import annotations

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
# (as the four-device check whose reference losses these are compared with: without LLVM's optimisations)
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))]

import jax  # noqa: E402
import numpy as np  # noqa: E402

from angel_jax.config import MeshConfig  # noqa: E402
from angel_jax.train.engines import InMemoryEngine  # noqa: E402
from angel_jax.train.protocol import named_leaves  # noqa: E402
from angel_jax.train.sharding import device_bytes, make_mesh  # noqa: E402
from test_fsdp import BATCH, MODEL, STEPS, cfg  # noqa: E402
from test_paged import batches  # noqa: E402


def main(port: int, process_id: int) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    assert jax.device_count() == 2 and jax.local_device_count() == 1
    engine = InMemoryEngine(cfg(), make_mesh(MeshConfig(fsdp=2), jax.devices()))
    rows = slice(process_id * BATCH // 2, (process_id + 1) * BATCH // 2)

    def global_batch(b: jax.Array) -> jax.Array:
        return jax.make_array_from_process_local_data(engine.batch_sharding, np.asarray(b)[rows])

    out = {"bytes": list(device_bytes(engine.state).values())}
    out["losses"] = [float(engine.step(global_batch(b))["loss"]) for b in batches(STEPS, MODEL, BATCH)]
    # A checkpoint's view of the state: every leaf whole on every process (leaves sharded across the processes
    # are gathered), loaded back into the sharded engine.
    snapshot = engine.state_snapshot()
    arrays = {k: np.array(v) for k, v in snapshot.arrays.items()}
    snapshot.release()
    shapes = {k: tuple(a.shape) for k, a in named_leaves(engine.state).items()}
    out["whole_shapes"] = all(arrays[k].shape == s for k, s in shapes.items())
    out["sharded_leaves"] = sum(not a.is_fully_addressable for a in jax.tree.leaves(engine.state))
    engine.load_state(arrays, engine.state_meta())
    again = {k: np.array(v) for k, v in engine.state_snapshot(may_hold=False).arrays.items()}
    out["round_trip"] = all(np.array_equal(arrays[k], again[k]) for k in arrays)
    engine.close()
    if process_id == 0:
        print(json.dumps(out), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
