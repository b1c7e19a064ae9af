"""What a clean one-step-delayed gradient costs: the main job trained in plain JAX, in memory, exactly and delayed.

    python experiments/bench/delayed_gradient_reference.py [--config experiments/gpt_tiny.yaml] [--steps 600]
        [--modes exact,delayed] [--delay-from K] [--replay STALE.json] [--compare METRICS.jsonl ...]
        [--losses-out DIR] [--write] [key=value ...]

The model, data and optimizer are the ones `angel-jax train` builds for the config (`models.get`, the loop's own
data iterator, `split_optimizer`: adamw, the warm-up + cosine schedule, weight decay, global-norm clipping), and a
step is the in-memory engine's two phases (train/step.py `make_step_phases`: `judge` = loss, gradients, global norm,
clipped gradients; `apply` = the optax update), jitted here without donation. Modes:

  exact     step t: gradient at params_{t-1}, applied to params_{t-1} (the in-memory engine's arithmetic)
  delayed   step t: gradient at params_{t-2} (the parameters before update t-1 was applied; step 1 uses params_0),
            clipped by its own global norm, applied to params_{t-1} with the current optimizer state and schedule
            step: a clean one-step-delayed update (ZeRO-Offload's DPU, Angel-PTM's lock-free update); with
            --delay-from K, steps before K are exact and the delay starts at step K (DPU's exact warm-up)
  replay    as delayed, but per stage (`StagedModel.split`): stage i's gradient at step t is taken at its
            params_{t-2} only where STALE.json says the paged engine ran that stage one update behind at step t,
            else at params_{t-1}. STALE.json: {"stale": [[stage flags of step 1], [of step 2], ...]} (0/1 per
            stage, in stage order). What the paged engine's lock-free mode should equal, if it is clean.

The loss of a step is the loss at the parameters its gradient is taken at (what every engine reports). The
anomaly guard's bounds are left unbounded (StepControls()): pass anomaly.enabled=false to the runs compared.

Figures (one JSON line each, appended to experiments/results/delayed_gradient_reference_<platform>.jsonl with
--write):

  run_<mode>        final training loss (mean of the last 50 steps' losses, as lockfree_convergence.py), first and
                    last loss, updates skipped (non-finite loss or norm), seconds
  delay_gap         (final loss delayed - exact) / exact, when both ran
  compare_<mode>    per --compare metrics.jsonl (an `angel-jax train` run's, train.log_every=1): the steps both
                    logged, the largest relative loss difference, the first step above --tolerance, and the
                    relative difference of each of the first 40 steps

STALE.json for replay comes from experiments/bench/lockfree_stale_trace.py (a paged run with staleness 1 that
records which stages each step ran one update behind).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from angel_jax.benchinfo import emit, machine_info, results_path
from angel_jax.config import load_config
from angel_jax.optim import split_optimizer
from angel_jax.optim.guard import StepControls
from angel_jax.train.loop import _data
from angel_jax.train.step import TrainState, init_state, make_step_phases
import models

ROOT = Path(__file__).resolve().parents[2]
TAIL = 50  # steps whose mean loss is the run's final loss (as experiments/bench/lockfree_convergence.py)


def build(cfg):
    """(initial TrainState, jitted judge, jitted apply, the staged model) as the in-memory engine builds them."""
    model = models.get(cfg.model, documents=cfg.data.packed)
    graphdef, _ = model.abstract()
    opt = split_optimizer(cfg.optimizer, cfg.train.steps)
    params = jax.jit(lambda: model.init(cfg.train.seed)[1])()
    state = jax.jit(lambda p: init_state(p, opt.tx))(params)
    phases = make_step_phases(graphdef, opt, model.loss, figures=model.figures)
    return state, jax.jit(phases.judge), jax.jit(phases.apply), model


def mixer(model):
    """mix(current, previous, stale[bool, n_stages]) -> whole-model params: stage i from `previous` where stale."""

    @jax.jit
    def mix(cur, prev, stale):
        cur_s, prev_s = model.split(cur), model.split(prev)
        return model.merge([jax.tree.map(lambda c, p, s=stale[i]: jnp.where(s, p, c), c_i, p_i)
                            for i, (c_i, p_i) in enumerate(zip(cur_s, prev_s))])

    return mix


def train(cfg, mode: str, steps: int, stale_plan: list[list[int]] | None = None, delay_from: int = 1) -> dict:
    """Train `steps` steps in `mode` (delayed: from step `delay_from` on); returns per-step losses (and grad
    norms) and the wall time."""
    state, judge, apply, model = build(cfg)
    data, _ = _data(cfg)
    n_stages = len(model.stages)
    controls = StepControls().as_numpy()
    mix = mixer(model)
    prev = state.params  # params_{t-2} at step t (params_0 at steps 1 and 2)
    losses, norms, skipped = [], [], 0
    start = time.perf_counter()
    for t in range(1, steps + 1):
        batch = jnp.asarray(next(data))
        if mode == "exact" or (mode == "delayed" and t < delay_from):
            at = state
        else:
            if mode == "delayed":
                flags = np.ones(n_stages, bool)
            else:  # replay: the paged run's stale stages of this step
                flags = np.asarray(stale_plan[t - 1], bool)
            at = TrainState(state.step, mix(state.params, prev, flags), state.opt_state)
        clipped, ok, metrics = judge(at, batch, controls)
        new = apply(state, clipped, ok, controls)
        prev, state = state.params, new
        m = jax.device_get(metrics)
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
        skipped += int(m["skipped"] >= 0.5)
    return {"losses": losses, "grad_norms": norms, "skipped": skipped, "seconds": time.perf_counter() - start}


def compare(losses: list[float], metrics_path: Path, tolerance: float) -> dict:
    """Step-by-step relative loss difference against an `angel-jax train` run's metrics.jsonl."""
    theirs = {r["step"]: r["loss"] for r in map(json.loads, metrics_path.read_text().splitlines())
              if r.get("loss") is not None}
    steps = sorted(s for s in theirs if s <= len(losses))
    rel = {s: abs(losses[s - 1] - theirs[s]) / abs(theirs[s]) for s in steps}
    first = next((s for s in steps if rel[s] > tolerance), None)
    return {"against": str(metrics_path), "steps_compared": len(steps),
            "max_rel_diff": max(rel.values()) if rel else None, "tolerance": tolerance,
            "first_step_above": first,
            "rel_diff_at_first": rel.get(first) if first else None,
            "rel_diff_by_step": {s: float(f"{rel[s]:.3g}") for s in steps[:40]}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=ROOT / "experiments" / "gpt_tiny.yaml")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--modes", default="exact,delayed", help="comma-separated: exact, delayed, replay")
    p.add_argument("--delay-from", type=int, default=1, help="mode delayed: exact steps before this one")
    p.add_argument("--replay", type=Path, help="STALE.json for mode replay (see the module docstring)")
    p.add_argument("--compare", type=Path, nargs="*", default=[], metavar="METRICS.jsonl",
                   help="metrics.jsonl per mode, in --modes order (an `angel-jax train` run to compare with)")
    p.add_argument("--tolerance", type=float, default=1e-5, help="relative loss difference for --compare")
    p.add_argument("--losses-out", type=Path, help="write each mode's per-step losses to DIR/<mode>.json")
    p.add_argument("--write", action="store_true", help="append the figures to experiments/results/")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if any(m not in ("exact", "delayed", "replay") for m in modes):
        p.error(f"unknown mode in {args.modes!r}")
    stale_plan = json.loads(args.replay.read_text())["stale"] if args.replay else None
    if "replay" in modes and stale_plan is None:
        p.error("mode replay needs --replay STALE.json")
    cfg = load_config(args.config, [f"train.steps={args.steps}", *args.overrides])
    results = results_path("delayed_gradient_reference") if args.write else None
    machine = machine_info()
    base = {"config": str(args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT) else args.config),
            "steps": args.steps, "overrides": args.overrides,
            **({"delay_from": args.delay_from} if args.delay_from > 1 else {})}
    final = {}
    for k, mode in enumerate(modes):
        run = train(cfg, mode, args.steps, stale_plan, args.delay_from)
        final[mode] = statistics.fmean(run["losses"][-TAIL:])
        emit({"figure": f"run_{mode}", **base, "final_loss": final[mode], "first_loss": run["losses"][0],
              "last_loss": run["losses"][-1], "skipped": run["skipped"], "seconds": round(run["seconds"], 1)},
             results, machine)
        if args.losses_out:
            args.losses_out.mkdir(parents=True, exist_ok=True)
            (args.losses_out / f"{mode}.json").write_text(json.dumps(run))
        if k < len(args.compare):
            emit({"figure": f"compare_{mode}", **base, **compare(run["losses"], args.compare[k], args.tolerance)},
                 results, machine)
    if "exact" in final and "delayed" in final:
        emit({"figure": "delay_gap", **base, "value": (final["delayed"] - final["exact"]) / final["exact"]},
             results, machine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
