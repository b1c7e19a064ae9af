"""Run by test_zero.py as two real processes of two CPU devices each (jax.distributed, gloo collectives): the paged
engine with every page sharded over the four devices (ZeRO-3), its host updates through the accelerator's path
(memory.accelerator_path: each rank's shards copied to the process's compute device, updated there alone, joined
back, the update's sum of squares summed over the ranks by a collective; memory/shardwise.py), the streamed stages
of the first run updated on their devices (memory.streamed_updates=device), those of the second on the host.

    python zero_mp_check.py PORT PROCESS_ID

Each process feeds its rows of every global batch; process 0 prints one JSON line: the losses, how many stages the
plan streams, and the page bytes this process's device holds in the device and host tiers (live shards). Then
the same pages with little host room and a disk tier (each process's own files, holding its part of every page):
where the plan homes each family, the bytes of this process's page files against the pages' whole bytes, and the
losses of DISK_STEPS steps, with the state snapshotted and loaded back (every page written to the disk tier
again) half way."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
# (as the four-device check whose reference losses these are compared with: without LLVM's optimisations)
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
                           " --xla_force_host_platform_device_count=2")
sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))]

import jax  # noqa: E402
import numpy as np  # noqa: E402

from angel_jax.config import MeshConfig  # noqa: E402
from angel_jax.train.engines import build_engine  # noqa: E402
from angel_jax.train.sharding import make_mesh  # noqa: E402
from test_zero import BATCH, DISK_STEPS, MP_STEPS, data, paged, tier_bytes  # noqa: E402

DEVICE_UPDATES_BUDGET = 1_400_000
"""Each rank's device budget in the first run: the step's minimum with two streamed stages' updates on the device."""


def main(port: int, process_id: int) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    assert jax.device_count() == 4 and jax.local_device_count() == 2
    base = paged(ranks=4)
    # Streamed stages updated on their devices (memory.streamed_updates=device: each rank's host shards cross to its
    # device for the update and back), with room for the pages of two such updates in flight.
    memory = dataclasses.replace(base.memory, accelerator_path=True, streamed_updates="device",
                                 device_budget=DEVICE_UPDATES_BUDGET)
    engine = build_engine(dataclasses.replace(base, memory=memory), make_mesh(MeshConfig(fsdp=4), jax.devices()))
    rows = slice(process_id * BATCH // 2, (process_id + 1) * BATCH // 2)
    try:
        losses = [float(engine.step(jax.make_array_from_process_local_data(engine.batch_sharding,
                                                                           np.asarray(b)[rows]))["loss"])
                  for b in data()[:MP_STEPS]]
        engine.built.updater.drain()
        engine.built.store.wait_all()
        store = engine.built.store
        out = {"losses": losses, "streamed": len(engine.built.plan.streamed),
               "shard_by_shard": engine.built.updater.placements["host"].shardwise is not None,
               "device_updates": len(engine.built.plan.streamed_device_updates),
               "host_peak_warning": engine.host_peak.check("the steps"), "host_planned": engine.host_peak.planned,
               "plan_peak": engine.built.plan.peak_bytes,
               "device": tier_bytes(store.tiers["device"]), "host": tier_bytes(store.tiers["host"])}
    finally:
        engine.close()
    with tempfile.TemporaryDirectory() as disk:
        out["disk"] = on_disk(Path(disk), rows)
    if process_id == 0:
        print(json.dumps(out), flush=True)
    jax.distributed.shutdown()


def on_disk(disk: Path, rows: slice) -> dict:
    base = paged(ranks=4)
    # An explicit disk budget: one taken from the free space could differ between the processes, and so the plans.
    memory = dataclasses.replace(base.memory, disk_dir=str(disk), host_budget=500_000, disk_budget=2**29,
                                 accelerator_path=True)
    engine = build_engine(dataclasses.replace(base, memory=memory), make_mesh(MeshConfig(fsdp=4), jax.devices()))
    batches = [jax.make_array_from_process_local_data(engine.batch_sharding, np.asarray(b)[rows])
               for b in data()[:DISK_STEPS]]
    try:
        plan, half = engine.built.plan, DISK_STEPS // 2
        losses = [float(engine.step(b)["loss"]) for b in batches[:half]]
        saved = {k: np.array(v) for k, v in engine.state_snapshot().arrays.items()}
        engine.load_state(saved, engine.state_meta())
        again = {k: np.array(v) for k, v in engine.state_snapshot().arrays.items()}
        losses += [float(engine.step(b)["loss"]) for b in batches[half:]]
        engine.built.store.wait_all()
        disk_tier = engine.built.store.tiers["disk"]
        files = sum(f.stat().st_size for f in Path(disk_tier.root).rglob("*") if f.is_file())
        return {"homes": {"params": plan.home.count("disk"), "gradients": plan.grad_home.count("disk"),
                          "optimizer": plan.opt_home.count("disk")}, "stages": len(plan.home),
                "disk_root": Path(disk_tier.root).name, "file_bytes": files, "counted_bytes": disk_tier.bytes_used,
                "round_trip_bit_exact": sorted(saved) == sorted(again) and all(
                    np.array_equal(saved[k], again[k]) for k in saved), "losses": losses}
    finally:
        engine.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
