"""The paged engine's blueprint: a model's page layouts and compiled stage functions from shapes alone, before any
page exists (what planning, profiling, checkpoint reading and the engine share).

    bp = blueprint(cfg)              # cached per configuration in the process
    bp.params_layout.stage("block").nbytes
    bp.sizes                         # what the budgets need to know of the model (schedule/budgets.py)
    params_layout(cfg)               # the parameter pages alone: nothing compiled
"""

from __future__ import annotations

import dataclasses
import json
import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import optax

from angel_jax.config import Config, ConfigError
from angel_jax.memory import PageLayout
from angel_jax.memory.layout import fit_page_size
from angel_jax.memory.sharded_layout import ShardedPageLayout
from angel_jax.optim import is_elementwise, make_optimizer
from angel_jax.optim.fused import host_optimizer
from angel_jax.optim.stage_update import OptLayout, abstract_opt_state, paged_paths
from angel_jax.schedule.plan import ModelBytes, StageCost
from angel_jax.schedule.stagefns import StageFunctions
from angel_jax.schedule.updater import StageUpdates
from angel_jax.schedule.zero import Zero
from angel_jax.units import human_bytes
import models
from models.stages import StagedModel


@dataclass
class Blueprint:
    """The model's page layouts and compiled stage functions, before any page exists."""

    staged: StagedModel
    params_layout: PageLayout
    opt_layout: PageLayout
    opt_structure: dict[str, OptLayout]
    opt_small: dict[str, list]
    """Per stage, zeros shaped like the optimizer's small leaves (step counts): profiling inputs."""
    fns: StageFunctions
    updates: StageUpdates
    schedule: Any
    sizes: ModelBytes
    """What the budgets need to know of the model: its stages' bytes and its parameters' layout on one device."""


def blueprint(cfg: Config, zero: Zero | None = None) -> Blueprint:
    """Layouts and compiled stage functions for the config's model, optimizer and page size, from shapes alone.
    Cached per process: engines of the same configuration (a benchmark's repeats, a restart in the same
    process) share the compiled functions instead of compiling them again."""
    key = json.dumps([dataclasses.asdict(cfg.model), cfg.data.packed, dataclasses.asdict(cfg.optimizer),
                      cfg.train.steps, cfg.memory.page_size, cfg.memory.page_fit, [d.id for d in zero.mesh.devices.flat] if zero else None],
                     sort_keys=True)
    with _BLUEPRINTS_LOCK:
        bp = _BLUEPRINTS.pop(key, None) or _blueprint(cfg, zero)
        _BLUEPRINTS[key] = bp  # most recently used last
        while len(_BLUEPRINTS) > _BLUEPRINTS_KEEP:
            _BLUEPRINTS.pop(next(iter(_BLUEPRINTS)))
        return bp


_BLUEPRINTS: dict[str, Blueprint] = {}
_BLUEPRINTS_KEEP = 4
_BLUEPRINTS_LOCK = threading.Lock()


def params_layout(cfg: Config) -> PageLayout:
    """The page layout of the model's parameters (the pages `params/<stage>/<k>` of a paged checkpoint), from
    shapes alone: nothing is allocated or compiled, so a checkpoint's pages can be read without building an
    engine."""
    staged = models.get(cfg.model)
    trees = list(zip([s.name for s in staged.stages], staged.stage_shapes()))
    apart = params_apart(staged)
    return PageLayout.build(trees, page_size_for(cfg, trees, apart), apart)


def page_size_for(cfg: Config, trees: list[tuple[str, Any]], apart: Callable[[str, str], bool] | None) -> int:
    """The page size of the model whose parameters are `trees` (its stages, unsharded): memory.page_size, fitted
    down to them with memory.page_fit. The optimizer state's pages take the same size (an elementwise optimizer's
    moments are the parameters' shapes again, so they fit it too). It depends on the model alone, not on the
    ranks the pages are sharded over, so a checkpoint's layout over other ranks is rebuilt with the same page size
    per rank."""
    return fit_page_size(trees, cfg.memory.page_size, apart) if cfg.memory.page_fit else cfg.memory.page_size


def page_size_text(cfg: Config) -> str:
    """The page size as the reports state it: 'page size 48.06 MiB (memory.page_size 64.00 MiB fitted to the
    stages)', or 'page size 64.00 MiB' when it is the configured one."""
    size = params_layout(cfg).page_size_bytes
    if size == cfg.memory.page_size:
        return f"page size {human_bytes(size)}"
    return f"page size {human_bytes(size)} (memory.page_size {human_bytes(cfg.memory.page_size)} fitted to the stages)"


def params_apart(staged: StagedModel) -> Callable[[str, str], bool] | None:
    """Which parameter leaves go on pages of their own: a mixture of experts' expert weights."""
    expert = staged.expert_leaf
    return (lambda stage, path: expert(path)) if expert else None


def opt_apart(staged: StagedModel, tx: optax.GradientTransformation, stage_params: list[Any]
              ) -> Callable[[str, str], bool] | None:
    """Which optimizer-state leaves go on pages of their own: those of the expert weights (the paged leaves are a
    list, `[i]`, in the order `paged_paths` names them)."""
    expert = staged.expert_leaf
    if not expert:
        return None
    keys = {(s.name, f"[{i}]") for s, p in zip(staged.stages, stage_params)
            for i, path in enumerate(paged_paths(tx, p)) if expert(path)}
    return lambda stage, path: (stage, path) in keys


def refuse_sharded_optimizer(cfg: Config) -> None:
    """ConfigError for an optimizer the sharded pages cannot run: one that needs each parameter's shape."""
    if cfg.optimizer.name == "adafactor":
        raise ConfigError("'optimizer.name': adafactor factors its moments by each parameter's shape, which a "
                          "rank's flat shard of it does not have: use adamw, adam, lion or sgd with pages sharded "
                          "over several devices")


def _blueprint(cfg: Config, zero: Zero | None = None) -> Blueprint:
    staged = models.get(cfg.model, documents=cfg.data.packed)  # rows of packed documents kept apart
    stage_params = staged.stage_shapes()
    tx, schedule = make_optimizer(cfg.optimizer, cfg.train.steps, clip=False)
    names = [s.name for s in staged.stages]
    if zero is not None and cfg.memory.staleness:
        raise ConfigError("'memory.staleness': lock-free updates (1) need pages on one device; with pages sharded "
                          "over several devices updates are exact (0)")
    if zero is not None:
        refuse_sharded_optimizer(cfg)

    trees = list(zip(names, stage_params))
    size = page_size_for(cfg, trees, params_apart(staged))

    def layout(trees: list[tuple[str, Any]], apart: Callable[[str, str], bool] | None) -> Any:
        if zero is None:
            return PageLayout.build(trees, size, apart)
        return ShardedPageLayout.build(trees, size, zero.ranks, apart)

    params_layout = layout(trees, params_apart(staged))
    opt_big, opt_small, structure = [], {}, {}
    for name, p in zip(names, stage_params):
        big, small, struct = abstract_opt_state(tx, p)
        opt_big.append(big)
        opt_small[name] = [np.zeros(s.shape, s.dtype) for s in small]
        structure[name] = struct
    opt_layout = layout(list(zip(names, opt_big)), opt_apart(staged, tx, stage_params))
    kernel = host_optimizer(cfg.optimizer, schedule)
    fns = StageFunctions(staged, params_layout, opt_layout, structure, tx, cfg.optimizer.grad_clip, zero,
                         elementwise=is_elementwise(cfg.optimizer), kernel=kernel)
    one_device = params_layout if zero is None else PageLayout.build(trees, size, params_apart(staged))
    sizes = ModelBytes([StageCost(n, params_layout.stage(n).nbytes, opt_layout.stage(n).nbytes, 0.0, 0.0, 0.0, 0.0)
                        for n in names], one_device)
    return Blueprint(staged, params_layout, opt_layout, structure, opt_small, fns,
                     StageUpdates(fns.update, fns.update_norm, fns.update_rank, fns.update_norm_rank), schedule, sizes)
