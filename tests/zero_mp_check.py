"""Run by test_zero.py as two real processes of one CPU device each (jax.distributed, gloo collectives): the paged
engine with every page sharded over the two processes' devices (ZeRO-3).

    python zero_mp_check.py PORT PROCESS_ID

Each process feeds its rows of every global batch; process 0 prints one JSON line: the losses, how many stages the
plan streams, and the page bytes this process's device holds in the device and host tiers (live shards)."""

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
from angel_jax.train.engines import build_engine  # noqa: E402
from angel_jax.train.sharding import make_mesh  # noqa: E402
from test_zero import BATCH, MP_STEPS, data, paged, tier_bytes  # noqa: E402


def main(port: int, process_id: int) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    assert jax.device_count() == 2 and jax.local_device_count() == 1
    engine = build_engine(paged(ranks=2), make_mesh(MeshConfig(fsdp=2), jax.devices()))
    rows = slice(process_id * BATCH // 2, (process_id + 1) * BATCH // 2)
    try:
        losses = [float(engine.step(jax.make_array_from_process_local_data(engine.batch_sharding,
                                                                           np.asarray(b)[rows]))["loss"])
                  for b in data()[:MP_STEPS]]
        engine.built.updater.drain()
        engine.built.store.wait_all()
        store = engine.built.store
        out = {"losses": losses, "streamed": len(engine.built.plan.streamed),
               "device": tier_bytes(store.tiers["device"]), "host": tier_bytes(store.tiers["host"])}
    finally:
        engine.close()
    if process_id == 0:
        print(json.dumps(out), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
