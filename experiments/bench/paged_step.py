"""Step time of paged training with one eighth of the model state on the device, against the in-memory reference
trainer in the same run, and the planner's predicted step time against the measured one.

    python experiments/bench/paged_step.py [CONFIG] [key=value ...] [--rounds R] [--steps N] [--warmup W]
                                           [--micro-batches M] [--write]

The default model (overrides below, on experiments/gpt_tiny.yaml) is sized so that the reference step takes over a
second on a 2-core CPU and one eighth of the training state (fp32 parameters + Adam moments) still holds the step's
activations and a streaming window: most stages stream. Both engines train on the same synthetic tokens; they are
timed in alternating rounds of N steps (each round: dispatch N steps, wait for the last one, updates included), so
machine noise hits both alike, and every ratio is taken within a round ("rounds" are these timing rounds).

The run restarts itself with malloc's huge pages (GLIBC_TUNABLES=glibc.malloc.hugetlb=1) unless that is set: the
workers `angel-jax launch` starts have them, and without them the profiled host updates, and with them the
prediction, move from one run to the next.

--micro-batches M (gradient accumulation; default 1): the global batch is M micro-batches of train.batch_size rows
(train.batch_size becomes M x those rows, train.micro_batch_size those rows); the device budget stays one eighth of
the training state. The paged engine runs them layer-major (a streamed stage fetched once, run for every
micro-batch); the reference runs the in-memory engine's gradient accumulation (train/step.py `make_step_phases`
with M micro-batches: a scan inside the jitted judge, then the donated apply), as train/engines.py builds it. With
M = 1 the reference is the single jitted step (`make_train_step`), as before.

The default shape does not fit eight micro-batches: layer-major, every micro-batch's stage inputs stay on the device
from the forward to the backward, (n_layers + 1) x M x rows x seq_len x d_model x 4 B = 157 MB at 8 x 2 rows of 256
tokens against a 64 MB budget. The figure in docs/paged-training.md with 8 micro-batches is taken with `model.seq_len=64
train.batch_size=1`: 8 micro-batches of one 64-token row, as many tokens per step as the default 2 x 256.

Figures (one JSON line each, with "micro_batches": M, appended to experiments/results/paged_step_<platform>.jsonl
with --write):

  paged_vs_reference   median over rounds of paged step / reference step (target <= 1.5 on the CPU; with several
                       micro-batches <= 1.1), for the reference with model.remat as configured and, as
                       a second reference, the other setting
  predicted_vs_measured  the plan's predicted step time / the paged engine's measured median (target within 25%;
                       with several micro-batches within 15%)
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

from angel_jax.memory.malloc import restart_with_huge_pages

# Measured as `angel-jax launch` runs its workers: malloc maps large buffers with huge pages. glibc reads the
# tunable once, at process start, hence the restart (both engines of the run get it alike).
restart_with_huge_pages(sys.argv)

import jax  # noqa: E402
import numpy as np

from angel_jax.benchinfo import emit, results_path
from angel_jax.config import Config, MemoryConfig, load_config
from angel_jax.optim import make_optimizer, split_optimizer
from angel_jax.schedule.runtime import build_paged_runtime
from angel_jax.train.step import StepControls, init_state, make_step_phases, make_train_step
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
    """The in-memory reference trainer's step on one device. One micro-batch: the single jitted step
    (train/step.py `make_train_step`), donated state. Several (train.micro_batch_size): the in-memory engine's
    gradient accumulation as train/engines.py builds it: `make_step_phases` with that many micro-batches (a scan
    over them in the jitted judge), then the jitted apply over the donated state."""

    def __init__(self, cfg: Config):
        graphdef, params = gpt.init(cfg.model, cfg.train.seed)
        self.micro_batches = cfg.train.micro_batches()
        if self.micro_batches == 1:
            tx, schedule = make_optimizer(cfg.optimizer, cfg.train.steps)
            self.state = init_state(params, tx)
            self._step = jax.jit(make_train_step(graphdef, tx, schedule, gpt.cross_entropy), donate_argnums=0)
            return
        opt = split_optimizer(cfg.optimizer, cfg.train.steps)
        self.state = init_state(params, opt.tx)
        phases = make_step_phases(graphdef, opt, gpt.cross_entropy, self.micro_batches)
        self._judge = jax.jit(phases.judge)
        self._apply = jax.jit(phases.apply, donate_argnums=0)
        self._controls = StepControls().as_numpy()

    def step(self, batch: jax.Array) -> dict:
        if self.micro_batches == 1:
            self.state, metrics = self._step(self.state, batch)
            return metrics
        clipped, ok, metrics = self._judge(self.state, batch, self._controls)
        self.state = self._apply(self.state, clipped, ok, self._controls)
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
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per engine after compiling")
    p.add_argument("--micro-batches", type=int, default=1,
                   help="micro-batches per step (gradient accumulation) of train.batch_size rows each")
    p.add_argument("--write", action="store_true", help="append the figures to experiments/results/")
    args = p.parse_args(argv)
    cfg = load_config(args.config, DEFAULTS + args.overrides)
    micro = args.micro_batches
    if micro > 1:  # M micro-batches of train.batch_size rows: the global batch grows, the state does not
        rows = cfg.train.batch_size
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=micro * rows,
                                                                 micro_batch_size=rows))
    budget = state_bytes(cfg) // 8
    cfg = dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, mode="paged", device_budget=budget))
    other = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat=not cfg.model.remat))

    rng = np.random.default_rng(0)
    batches = [jax.device_put(rng.integers(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.model.seq_len + 1),
                                           dtype=np.int32)) for _ in range(4)]
    t0 = time.perf_counter()
    params = jax.tree.map(np.array, gpt.init(cfg.model, cfg.train.seed)[1])
    paged = build_paged_runtime(cfg, params, batches[0])
    build_s = time.perf_counter() - t0
    del params
    plan = paged.plan
    engines = {"paged": paged.executor.step, "reference": Reference(cfg).step, "reference_other": Reference(other).step}
    for step in engines.values():  # compile and warm up
        timed_round(step, batches, args.warmup)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, step in engines.items():
            times[name].append(timed_round(step, batches, args.steps))
    paged.close()

    med = {name: statistics.median(t) for name, t in times.items()}
    ratio_target, error_target = (1.5, 0.25) if micro == 1 else (1.1, 0.15)
    common = {
        "bench": "paged_step", "config": cfg.name, "overrides": DEFAULTS + args.overrides, "micro_batches": micro,
        "batch_size": cfg.train.batch_size, "micro_batch_size": cfg.train.micro_batch_size or cfg.train.batch_size,
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
              "target": ratio_target, "meets_target": statistics.median(ratios) <= ratio_target},
             results_path("paged_step") if args.write else None)
    error = plan.predicted.step_time / med["paged"] - 1
    emit({**common, "figure": "predicted_vs_measured", "predicted_step_s": round(plan.predicted.step_time, 4),
          "measured_step_s": round(med["paged"], 4), "relative_error": round(error, 4), "target": error_target,
          "meets_target": abs(error) <= error_target}, results_path("paged_step") if args.write else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
