"""What a plan's record (`plan.json`, written by `angel-jax plan` and by the paged engine into its run directory)
holds, and the MFU a plan predicts: shared by the engine and the CLI, so the engine imports no CLI module."""

from __future__ import annotations

from dataclasses import asdict

from angel_jax.config import Config
from angel_jax.schedule.plan import Bandwidths, Budgets, Plan, StageCost
import models


def predicted_mfu(cfg: Config, plan: Plan, peak_flops: float) -> float:
    """Model FLOPs of a step (the training loop's perf/mfu formula: `flops_per_token` x tokens of the global
    batch, no recompute) over the predicted step time at `peak_flops` per device, of each of the plan's ranks."""
    tokens = cfg.train.batch_size * cfg.model.seq_len
    return models.get(cfg.model).flops_per_token * tokens / (plan.predicted.step_time * peak_flops * plan.ranks)


def plan_summary(plan: Plan, costs: list[StageCost], budgets: Budgets, bw: Bandwidths, source: str,
                 param_count: dict[str, int], cfg: Config | None = None, peak_flops: float | None = None) -> dict:
    """What plan.json holds: the plan's summary, the model's parameter counts, each stage's homes per family,
    bytes per tier, I/O, budgets, what bounds the step and (with a peak) the predicted MFU."""
    bound, shares = plan.bound(costs[0].name)
    extra = {"bound": bound, "stream_shares": shares, "compute_waits_s": dict(plan.predicted.waits)}
    if cfg is not None:
        extra["micro_batch_size"] = cfg.train.micro_batch_size or cfg.train.batch_size // plan.ranks
        extra["batch_size"] = cfg.train.batch_size
    if cfg is not None and peak_flops:
        extra.update(predicted_mfu=predicted_mfu(cfg, plan, peak_flops), peak_flops=peak_flops)
    return {**plan.summary(), **extra, "source": source, "param_count": dict(param_count), "table": plan.table(costs),
            "homes": {"params": list(plan.home), "gradients": list(plan.grad_home),
                      "optimizer": list(plan.opt_home)},
            "io_per_step": plan.io_per_step(costs, bw),
            "budgets": {"device": budgets.device, "host": budgets.host, "disk": budgets.disk,
                        "fixed_device": plan.fixed_device},
            "stages": [asdict(c) for c in costs]}
