"""Tokens/s and MFU of the reference trainer's step for a config.

    python experiments/bench/reference_step.py experiments/gpt_tiny.yaml [key=value ...] [--steps N] [--write]

Compiles, warms up, then times N steps on synthetic tokens (data loading is not part of the figure), and prints
one JSON line; appends it to experiments/results/reference_step_<platform>.jsonl with --write.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from angel_jax.benchinfo import emit, results_path
from angel_jax.config import load_config
from angel_jax.optim import make_optimizer
from angel_jax.train.metrics import device_peak, throughput
from angel_jax.train.step import init_state, make_train_step
from models import gpt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--steps", type=int, default=10, help="timed steps (after 2 warm-up steps)")
    p.add_argument("--write", action="store_true", help="append the figures to experiments/results/")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.overrides)

    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    tx, schedule = make_optimizer(cfg.optimizer, cfg.train.steps)
    graphdef, _ = gpt.abstract_params(cfg.model)
    state = jax.jit(lambda: init_state(gpt.init(cfg.model, cfg.train.seed)[1], tx),
                    out_shardings=NamedSharding(mesh, P()))()
    step = jax.jit(make_train_step(graphdef, tx, schedule, gpt.cross_entropy), donate_argnums=0)
    rng = np.random.default_rng(0)
    batch = jax.device_put(rng.integers(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.model.seq_len + 1),
                                        dtype=np.int32), NamedSharding(mesh, P("data")))

    t0 = time.perf_counter()
    state, m = step(state, batch)
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0
    state, m = step(state, batch)
    jax.block_until_ready(m)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)

    step_time = statistics.median(times)
    peak = device_peak(devices[0])
    perf = throughput(step_time, cfg.train.batch_size * cfg.model.seq_len, gpt.flops_per_token(cfg.model), peak,
                      len(devices))
    record = {
        "bench": "reference_step", "config": cfg.name, "overrides": args.overrides,
        "params": gpt.param_count(cfg.model)["total"], "batch_size": cfg.train.batch_size,
        "seq_len": cfg.model.seq_len, "compute_dtype": cfg.model.compute_dtype, "remat": cfg.model.remat,
        "compile_s": round(compile_s, 3), "step_time_s": round(step_time, 5),
        "step_time_min_s": round(min(times), 5), "tokens_per_s": round(perf["perf/tokens_per_s"], 1),
        "tflops": round(perf["perf/tflops"], 4), "mfu": round(perf["perf/mfu"], 4),
        "peak_flops_per_device": peak.flops_per_device, "peak_source": peak.source,
    }
    emit(record, results_path("reference_step") if args.write else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
