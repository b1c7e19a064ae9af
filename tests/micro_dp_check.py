"""Run by test_micro_batches.py in its own process with two CPU devices: the in-memory engine's data-parallel step
with micro-batches against the whole batch in one go, and where its gradient reduction sits."""

from __future__ import annotations

import json
import os
import re
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))]

import jax  # noqa: E402

from angel_jax.optim.guard import StepControls  # noqa: E402
from angel_jax.train.engines import InMemoryEngine  # noqa: E402
import test_micro_batches as micro_test  # noqa: E402


def main() -> None:
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    out: dict = {"losses": {}}
    for micro in (0, micro_test.MICRO):
        engine = InMemoryEngine(micro_test._cfg(micro), mesh)
        data = [jax.device_put(b, engine.batch_sharding) for b in micro_test._data()[:3]]
        if micro:
            text = engine._judge.lower(engine.state, data[0], StepControls().as_numpy()).compile().as_text()
            # Per computation of the compiled program: the all-reduces outside the entry computation run in the
            # micro-batch loop's body.
            out["all_reduce_in_loop"] = sum(c.count("all-reduce(") + c.count("all-reduce-start(")
                                            for c in re.split(r"\n(?=\S.*\{\n)", text) if not c.startswith("ENTRY"))
            out["all_reduce"] = text.count("all-reduce(") + text.count("all-reduce-start(")
        out["losses"][micro] = [float(engine.step(b)["loss"]) for b in data]
        engine.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
