"""Build the paged engine from a config: layouts -> stage functions -> profiled costs -> plan -> page store.

    engine = build_paged_engine(cfg, params, tokens_example)
    metrics = engine.executor.step(batch)

`memory.mode: auto` uses the paged engine only when the in-memory state does not fit the device budget.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import psutil

from angel_jax.config import Config
from angel_jax.memory import DeviceTier, DiskTier, HostTier, PageLayout, PageStore
from angel_jax.optim import make_optimizer
from angel_jax.schedule.costs import profile_costs
from angel_jax.schedule.execute import PagedExecutor, PagedModel
from angel_jax.schedule.plan import Bandwidths, Budgets, Plan, StageCost, make_plan
from angel_jax.schedule.stagefns import StageFunctions, split_opt_state
from models import gpt

log = logging.getLogger(__name__)

CALIBRATION = Path.home() / ".cache" / "angel_jax" / "io_calibration.json"


@dataclass
class PagedEngine:
    executor: PagedExecutor
    plan: Plan
    costs: list[StageCost]
    budgets: Budgets
    layout: PageLayout
    store: PageStore

    def close(self) -> None:
        self.store.close()


def device_budget(cfg: Config, device: jax.Device) -> int:
    """memory.device_budget, or what the device has free (host RAM available for the CPU backend)."""
    if cfg.memory.device_budget:
        return cfg.memory.device_budget
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    return int(psutil.virtual_memory().available * 0.8)


def fixed_device_bytes(cfg: Config, local_batch: int) -> int:
    """Device bytes every step needs whatever the placement: the saved input of every stage, and the working set
    of the largest stage call (logits and their gradient for the head; attention and MLP intermediates for a
    block), estimated from shapes."""
    m = cfg.model
    itemsize = jnp.dtype(m.compute_dtype).itemsize
    tokens = local_batch * m.seq_len
    saved = (m.n_layers + 1) * tokens * m.d_model * itemsize
    head = 3 * tokens * m.vocab_size * 4
    block = tokens * (3 * m.d_model + 2 * int(m.d_model * m.mlp_ratio)) * itemsize * 2 \
        + local_batch * m.n_heads * m.seq_len * m.seq_len * 4
    return saved + max(head, block) + tokens * 8


def build_paged_engine(cfg: Config, params: Any, example_batch: jax.Array, *,
                       record_timeline: bool = False) -> PagedEngine:
    device = jax.local_devices()[0]
    staged = gpt.staged(cfg.model)
    tx, schedule = make_optimizer(cfg.optimizer, cfg.train.steps, clip=False)
    host_params = [jax.tree.map(np.asarray, p) for p in staged.split(params)]
    names = [s.name for s in staged.stages]
    params_layout = PageLayout.build(zip(names, host_params), cfg.memory.page_size)

    opt_big, opt_small, structure = [], [], {}
    for name, p in zip(names, host_params):
        big, small, struct = split_opt_state(tx.init(p))
        opt_big.append([np.asarray(b) for b in big])
        opt_small.append(small)
        structure[name] = struct
    opt_layout = PageLayout.build(zip(names, opt_big), cfg.memory.page_size)
    fns = StageFunctions(staged, params_layout, opt_layout, structure, tx, cfg.optimizer.grad_clip)

    store = PageStore(DeviceTier(device, budget=None), HostTier(device, budget=cfg.memory.host_budget or None),
                      DiskTier(cfg.memory.disk_dir, budget=cfg.memory.disk_budget or None)
                      if cfg.memory.disk_dir else None)
    device_sharding = store.tiers["device"].sharding
    host_sharding = store.tiers["host"].sharding
    costs = profile_costs(fns, params_layout, opt_layout, dict(zip(names, opt_small)),
                          jax.device_put(example_batch, device_sharding), device_sharding)
    fixed = fixed_device_bytes(cfg, example_batch.shape[0])
    if device.platform == "cpu":
        # The CPU backend is both the device and the host-update engine: a host update's inputs and outputs
        # (parameters, gradients, optimizer state of one stage, twice) are device memory there.
        fixed += 2 * max(2 * c.param_bytes + c.opt_bytes for c in costs)
    budgets = Budgets(device=device_budget(cfg, device), host=cfg.memory.host_budget or None,
                      disk=(cfg.memory.disk_budget or None) if cfg.memory.disk_dir else 0, fixed_device=fixed)
    plan = make_plan(costs, Bandwidths.load(CALIBRATION), budgets)
    store.tiers["device"].budget = budgets.device

    model = PagedModel(staged, params_layout, opt_layout, opt_offset=params_layout.num_pages)
    for i, name in enumerate(names):
        home = plan.home[i]
        for pid, page in zip(model.param_ids(i), params_layout.stage(name).pack(host_params[i])):
            store.add(pid, page, home=home)
        for oid, page in zip(model.opt_ids(i), opt_layout.stage(name).pack(opt_big[i])):
            store.add(oid, page, home=plan.opt_home[i])
    store.wait_all()
    small_placed = [jax.device_put(s, host_sharding if plan.home[i] == "host" else device_sharding)
                    for i, s in enumerate(opt_small)]
    executor = PagedExecutor(model, fns, plan, store, small_placed, schedule, record=record_timeline)
    log.info("paged engine: %d stages, %d resident, prefetch %d, predicted step %.3f s",
             len(names), len(plan.resident), plan.prefetch, plan.predicted.step_time)
    return PagedEngine(executor, plan, costs, budgets, params_layout, store)
