"""Step time of paged training with one eighth of the model state on the device, against the in-memory reference
trainer in the same run, and the planner's predicted step time against the measured one.

    python experiments/bench/paged_step.py [CONFIG] [key=value ...] [--rounds R] [--steps N] [--no-save]

The default model (overrides below, on experiments/gpt_tiny.yaml) is sized so that the reference step takes over a
second on a 2-core CPU and one eighth of the training state (fp32 parameters + Adam moments) still holds the step's
activations and a streaming window: most stages stream. Both engines train on the same synthetic tokens; they are
timed in alternating rounds of N steps (each round: dispatch N steps, wait for the last one, updates included), so
machine noise hits both alike, and every ratio is taken within a round. Figures (one JSON line each, appended to
experiments/results/paged_step_<platform>.jsonl unless --no-save):

  paged_vs_reference   median over rounds of paged step / reference step (target <= 1.5 on the CPU), for the
                       reference with model.remat as configured and, as a second reference, the other setting
  predicted_vs_measured  the plan's predicted step time / the paged engine's measured median (target within 25%)
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

from angel_jax.benchinfo import emit, results_path
from angel_jax.config import Config, MemoryConfig, load_config
from angel_jax.optim import make_optimizer
from angel_jax.schedule.engine import build_paged_engine
from angel_jax.train.step import init_state, make_train_step
from models import gpt

ROOT = Path(__file__).resolve().parents[2]
DEFAULTS = ["model.d_model=384", "model.n_layers=24", "model.n_heads=6", "model.seq_len=256", "model.remat=true",
            "train.batch_size=2", "train.steps=1000", "memory.page_size=7097856"]
"""A block's parameters are 7,097,856 B: one page per block."""


def state_bytes(cfg: Config) -> int:
    """fp32 parameters + optimizer state (the quantity the device budget is an eighth of)."""
    tx, _ = make_optimizer(cfg.optimizer, cfg.train.steps)
    _, abstract = gpt.abstract_params(cfg.model)
    opt = jax.eval_shape(tx.init, abstract)
    return sum(np.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves((abstract, opt)))


class Reference:
    """The in-memory reference trainer's jitted step (train/step.py), donated state, as train/engines.py runs it."""

    def __init__(self, cfg: Config):
        tx, schedule = make_optimizer(cfg.optimizer, cfg.train.steps)
        graphdef, params = gpt.init(cfg.model, cfg.train.seed)
        self.state = init_state(params, tx)
        self._step = jax.jit(make_train_step(graphdef, tx, schedule, gpt.cross_entropy), donate_argnums=0)

    def step(self, batch: jax.Array) -> dict:
        self.state, metrics = self._step(self.state, batch)
        return metrics


def timed_round(step, batches: list, steps: int) -> float:
    """Seconds per step over `steps` steps, dispatched back to back, until the last one's metrics exist."""
    t0 = time.perf_counter()
    for k in range(steps):
        metrics = step(batches[k % len(batches)])
    jax.block_until_ready({k: np.asarray(v) for k, v in metrics.items()})
    return (time.perf_counter() - t0) / steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", default=str(ROOT / "experiments" / "gpt_tiny.yaml"))
    p.add_argument("overrides", nargs="*")
    p.add_argument("--rounds", type=int, default=5, help="alternating timed rounds per engine")
    p.add_argument("--steps", type=int, default=5, help="steps per round")
    p.add_argument("--no-save", action="store_true", help="print only, do not append to experiments/results")
    args = p.parse_args(argv)
    cfg = load_config(args.config, DEFAULTS + args.overrides)
    budget = state_bytes(cfg) // 8
    cfg = dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, mode="paged", device_budget=budget))
    other = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat=not cfg.model.remat))

    rng = np.random.default_rng(0)
    batches = [jax.device_put(rng.integers(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.model.seq_len + 1),
                                           dtype=np.int32)) for _ in range(4)]
    t0 = time.perf_counter()
    params = jax.tree.map(np.array, gpt.init(cfg.model, cfg.train.seed)[1])
    paged = build_paged_engine(cfg, params, batches[0])
    build_s = time.perf_counter() - t0
    del params
    plan = paged.plan
    engines = {"paged": paged.executor.step, "reference": Reference(cfg).step, "reference_other": Reference(other).step}
    for step in engines.values():  # compile and warm up
        timed_round(step, batches, 3)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, step in engines.items():
            times[name].append(timed_round(step, batches, args.steps))
    paged.close()

    med = {name: statistics.median(t) for name, t in times.items()}
    common = {
        "bench": "paged_step", "config": cfg.name, "overrides": DEFAULTS + args.overrides,
        "params": gpt.param_count(cfg.model)["total"], "state_bytes": state_bytes(cfg), "device_budget": budget,
        "stages": len(plan.home), "streamed": len(plan.streamed), "prefetch": plan.prefetch,
        "rounds": args.rounds, "steps_per_round": args.steps, "engine_build_s": round(build_s, 2),
        "step_s": {name: [round(t, 4) for t in ts] for name, ts in times.items()},
        "step_s_median": {name: round(t, 4) for name, t in med.items()},
    }
    for ref, remat in (("reference", cfg.model.remat), ("reference_other", other.model.remat)):
        ratios = [pg / rf for pg, rf in zip(times["paged"], times[ref])]
        emit({**common, "figure": "paged_vs_reference", "reference_remat": remat,
              "ratio_median": round(statistics.median(ratios), 4), "ratios": [round(r, 4) for r in ratios],
              "target": 1.5, "meets_target": statistics.median(ratios) <= 1.5},
             None if args.no_save else results_path("paged_step"))
    error = plan.predicted.step_time / med["paged"] - 1
    emit({**common, "figure": "predicted_vs_measured", "predicted_step_s": round(plan.predicted.step_time, 4),
          "measured_step_s": round(med["paged"], 4), "relative_error": round(error, 4), "target": 0.25,
          "meets_target": abs(error) <= 0.25}, None if args.no_save else results_path("paged_step"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
