"""Run by test_zero_checkpoint.py as two real processes of one CPU device each (jax.distributed, gloo): the
sharded paged engine with its pages split across the processes, checkpointed through the trainer's checkpointer
and restored into a fresh engine over the same two processes.

    python zero_ckpt_mp_check.py PORT PROCESS_ID DIRECTORY

Each process feeds its rows of every global batch. Every process prints one JSON line: whether its pages span
the processes, the uninterrupted losses, the resumed ones, and whether the restored state equals the saved one
bit for bit."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))]

import zero_ckpt_check as z  # noqa: E402  (sets nothing but JAX_PLATFORMS when imported)

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + z.FAST_COMPILE

import jax  # noqa: E402
import numpy as np  # noqa: E402

from angel_jax.config import MeshConfig  # noqa: E402
from angel_jax.train.checkpointing import TrainCheckpointer  # noqa: E402
from angel_jax.train.engines import build_engine  # noqa: E402
from angel_jax.train.sharding import make_mesh  # noqa: E402
import test_paged as tp  # noqa: E402


def main(port: int, process_id: int, directory: Path) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    assert jax.device_count() == 2 and jax.local_device_count() == 1
    c = z.cfg(directory, "mp")
    data = tp.batches(z.STEPS, z.MODEL, z.BATCH)
    rows = slice(process_id * z.BATCH // 2, (process_id + 1) * z.BATCH // 2)

    def engine():
        return build_engine(c, make_mesh(MeshConfig(fsdp=2), jax.devices()))

    def run(e, batches: list) -> list[float]:
        return [float(e.step(jax.make_array_from_process_local_data(e.batch_sharding, np.asarray(b)[rows]))["loss"])
                for b in batches]

    c.run_dir.mkdir(parents=True, exist_ok=True)
    checkpointer = TrainCheckpointer(c, c.run_dir, primary=process_id == 0)
    e = engine()
    out = {"process": process_id, "spans_processes": e._spans_processes()}
    losses = run(e, data[:z.SAVE_AT])
    snapshot = e.state_snapshot()  # every process, as the training loop does at a checkpoint
    saved = {k: np.array(v) for k, v in snapshot.arrays.items()}
    checkpointer.save(z.SAVE_AT, snapshot, {"engine": e.state_meta()})
    checkpointer.wait()  # process 0: committed before it answers restore_latest's question below
    out["uninterrupted"] = losses + run(e, data[z.SAVE_AT:])
    e.close()
    step, arrays, meta, tier = checkpointer.restore_latest()
    e = engine()
    e.load_state(arrays, meta["engine"])
    out.update(step=step, tier=tier, ranks=meta["engine"].get("ranks"), bit_exact=z.same(saved, z.state(e)),
               resumed=run(e, data[z.SAVE_AT:]))
    e.close()
    checkpointer.close()
    print(json.dumps(out), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
