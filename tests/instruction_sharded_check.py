"""Run by test_instruction_data.py in its own process with four CPU devices: the response-only loss of packed
instruction rows in the sharded engines, against the in-memory engine on one device with whole batches.

    python instruction_sharded_check.py

Prints one JSON line: per engine, the losses and gradient norms of three steps; each rank's rows of each
micro-batch hold a different number of scored targets (`uneven`)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
                           " --xla_backend_optimization_level=0")
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))]

import jax  # noqa: E402
import numpy as np  # noqa: E402

from angel_jax.config import MeshConfig  # noqa: E402
from angel_jax.train.engines import InMemoryEngine, build_engine  # noqa: E402
from angel_jax.train.sharding import make_mesh  # noqa: E402
from test_instruction_data import LLAMA, PAGE, ROW, _cfg, _rows  # noqa: E402

RANKS, BATCH, MICRO = 4, 8, 1  # two micro-batches of one row on each rank


def run(engine, batches: list) -> dict[str, list[float]]:
    metrics = [engine.step(jax.device_put(b, engine.batch_sharding)) for b in batches]
    return {key: [float(m[key]) for m in metrics] for key in ("loss", "grad_norm")}


def main() -> None:
    batches = list(_rows(3 * BATCH, pack=True, seed=6).reshape(3, BATCH, ROW))
    per_row = {int(np.sum(row[1:] >= 0)) for b in batches for row in b}  # a rank's rows of a micro-batch: one
    with tempfile.TemporaryDirectory() as tmp:
        base = _cfg(Path(tmp), LLAMA, pack=True)
        base = dataclasses.replace(base, train=dataclasses.replace(base.train, batch_size=BATCH))
        micro = dataclasses.replace(base.train, micro_batch_size=MICRO)
        one = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1], axis_types=(jax.sharding.AxisType.Auto,))
        mesh = make_mesh(MeshConfig(fsdp=RANKS), jax.devices())
        out = {"uneven": len(per_row) > 1}
        for name, cfg, on in (
                ("reference", base, one),
                ("in_memory", dataclasses.replace(base, train=micro), mesh),
                ("paged", dataclasses.replace(base, train=micro, memory=dataclasses.replace(
                    base.memory, mode="paged", page_size=PAGE)), mesh)):
            engine = InMemoryEngine(cfg, on) if name != "paged" else build_engine(cfg, on)
            try:
                out[name] = run(engine, batches)
            finally:
                engine.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
