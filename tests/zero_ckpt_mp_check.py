"""Run by test_zero_checkpoint.py as two real processes of one CPU device each (jax.distributed, gloo): the
sharded paged engine with its pages split across the processes, each process checkpointing its own shards
through the trainer's checkpointer (memory tier, peer copy, persistent tier), restored into a fresh engine over the
same two processes, where a newer step that process 1 cannot restore (every copy of its shards damaged) makes both
go back to the older one; then process 0's memory tier is deleted (the loss of its host's memory) and both restore
again. Last, the two processes resume the checkpoint zero_ckpt_check.py wrote over one rank (1 -> 2 processes),
on the machine's own budgets.

    python zero_ckpt_mp_check.py PORT PROCESS_ID DIRECTORY

Each process feeds its rows of every global batch. Every process prints one JSON line: whether its pages span
the processes, the bytes of its shards and of the whole state, what its memory tier holds, the uninterrupted
losses, the resumed ones, whether each restored state equals the saved one bit for bit, and the tiers. When both
are done (checkpoints persisted), each leaves `mp-done-<process>` in DIRECTORY: zero_ckpt_check.py then resumes
the checkpoint in one process."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))]

import zero_ckpt_check as z  # noqa: E402  (sets nothing but JAX_PLATFORMS when imported)

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + z.FAST_COMPILE

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.multihost_utils import sync_global_devices  # noqa: E402

from angel_jax.config import MeshConfig  # noqa: E402
from angel_jax.train.checkpointing import TrainCheckpointer  # noqa: E402
from angel_jax.cli.ckpt import verify_report  # noqa: E402
from angel_jax.train.engines import build_engine  # noqa: E402
from angel_jax.train.sharding import make_mesh  # noqa: E402
import test_paged as tp  # noqa: E402


def flip_a_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


def main(port: int, process_id: int, directory: Path) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    assert jax.device_count() == 2 and jax.local_device_count() == 1
    c = z.cfg(directory, "mp", peer=True)
    data = tp.batches(z.STEPS, z.MODEL, z.BATCH)
    rows = slice(process_id * z.BATCH // 2, (process_id + 1) * z.BATCH // 2)

    def engine():
        return build_engine(c, make_mesh(MeshConfig(fsdp=2), jax.devices()))

    def run(e, batches: list) -> list[float]:
        return [float(e.step(jax.make_array_from_process_local_data(e.batch_sharding, np.asarray(b)[rows]))["loss"])
                for b in batches]

    c.run_dir.mkdir(parents=True, exist_ok=True)
    e = engine()

    def checkpointer() -> TrainCheckpointer:
        return TrainCheckpointer(c, c.run_dir, primary=process_id == 0, per_process=e.checkpoints_per_process)

    saving = checkpointer()
    out = {"process": process_id, "spans_processes": e._spans_processes(), "per_process": saving.per_process}
    losses = run(e, data[:z.SAVE_AT])
    snapshot = e.state_snapshot()  # every process, as the training loop does at a checkpoint
    saved = {k: np.array(v) for k, v in snapshot.arrays.items()}
    pages = [k for k in saved if k.startswith(("params/", "opt/"))]
    out["shard_bytes"] = sum(saved[k].nbytes for k in pages)
    out["whole_bytes"] = sum(e._page_spec(pid)[0][0] * e._page_spec(pid)[1].itemsize
                             for _, pid in e._names()[0] + e._names()[1])
    saving.save(z.SAVE_AT, snapshot, {"engine": e.state_meta()})
    saving.close()  # committed in every tier (memory, peer, persistent)
    memory = saving.options.resolved_memory_dir()
    out["memory_tier"] = {"dir": str(memory.relative_to(directory)),
                          "bytes": sum(f.stat().st_size for f in memory.rglob("*") if f.is_file())}
    out["uninterrupted"] = losses + run(e, data[z.SAVE_AT:])
    # A newer step that process 1 cannot restore: its every copy of it damaged (memory, peer, persistent).
    saving = checkpointer()
    saving.save(z.STEPS, e.state_snapshot(), {"engine": e.state_meta()})
    saving.close()
    if process_id == 1:  # the memory and peer snapshots' data, and the data files of the orbax checkpoint
        for copy in sorted(directory.rglob(f"process_1/step_{z.STEPS}/data.bin")):
            flip_a_byte(copy)
        for copy in sorted((c.run_dir / "checkpoints" / "process_1" / str(z.STEPS) / "state").rglob("d/*")):
            flip_a_byte(copy)
    sync_global_devices("newest step damaged")
    e.close()
    e = engine()
    restoring = checkpointer()
    step, arrays, meta, tier = restoring.restore_latest()
    restoring.close()
    e.load_state(arrays, meta["engine"])
    out.update(step=step, tier=tier, ranks=meta["engine"].get("ranks"), bit_exact=z.same(saved, z.state(e)),
               resumed=run(e, data[z.SAVE_AT:]))
    # Process 0's host loses its memory: its snapshots are gone, its neighbour's copy (the peer tier) is not.
    if process_id == 0:
        shutil.rmtree(memory)
    sync_global_devices("memory lost")
    restoring = checkpointer()
    step, arrays, meta, tier = restoring.restore_latest()
    restoring.close()
    out["after_memory_lost"] = {"step": step, "tier": tier,
                                "bit_exact": z.same(saved, {k: np.array(v) for k, v in arrays.items()})}
    e.close()
    if process_id == 0:  # `angel-jax ckpt verify`: every process's shards, checksummed
        out["verify"] = verify_report(c.run_dir)
    (directory / f"mp-done-{process_id}").write_text(json.dumps(out["uninterrupted"]))
    # 4 ranks -> 2 processes: the checkpoint zero_ckpt_check.py wrote over four ranks, resumed over these two processes
    # from its persistent tier, on the machine's own budgets (memory.device_budget 0: each process asks its own
    # device for its free memory; process 0's device, which the mesh lists first, refuses another process's).
    deadline = time.time() + 200
    while not (directory / "other-world-saved").is_file() and time.time() < deadline:
        time.sleep(0.2)
    one = z.cfg(directory, "other-world")
    one = dataclasses.replace(one, memory=dataclasses.replace(one.memory, device_budget=0))
    e = build_engine(one, make_mesh(MeshConfig(fsdp=2), jax.devices()))
    restoring = TrainCheckpointer(one, one.run_dir, primary=process_id == 0, per_process=e.checkpoints_per_process)
    step, arrays, meta, tier = restoring.restore_latest()
    restoring.close()
    e.load_state(arrays, meta["engine"])
    out["other_world"] = {"step": step, "tier": tier, "losses": run(e, data[z.SAVE_AT:])}
    e.close()
    print(json.dumps(out), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
