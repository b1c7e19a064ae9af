"""A trained model's parameters, read from a run directory's checkpoints, whichever engine wrote them.

    weights = load_params(Path("runs/gpt_tiny"))          # the newest valid checkpoint (or step=N)
    weights.cfg, weights.step                             # the run's resolved config, the step
    weights.params                                        # numpy, in the family's `init` structure

What `TrainEngine.params()` returns at that step, from the checkpoint alone: no engine is built and nothing of
the optimizer state is read. The checkpoint engine's restore is used as training uses it (memory tier -> peer ->
persistent, a damaged copy skipped for the next), restricted to the parameter arrays, so only their bytes are read
and checksummed. A run whose processes checkpointed their own shards (train/checkpointing.py) is read from every
process's persistent tier, assembled (there every array is checksummed, the optimizer state's too). The two engines name them differently (train/protocol.py, train/paged.py):

    in_memory   params/<path in the params tree>   one array per leaf, e.g. params/blocks/qkv/kernel
    paged       params/<stage>/<k>                 the k-th page of a stage, unpacked with the page layout that
                                                   the paged engine builds from the model config and page size
                                                   (rebuilt here from shapes; checked against the checkpoint's
                                                   layout fingerprint)
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np

from angel_jax.checkpoint import CheckpointEngine, CheckpointError, CheckpointOptions
from angel_jax.config import Config, ConfigError, load_recorded_config
from angel_jax.memory.sharded_layout import layout_over
from angel_jax.schedule.blueprint import params_layout
from angel_jax.train.checkpointing import (assemble_newest, check_same_model, checkpoint_options, owns_memory_tier,
                                          shard_steps)
from angel_jax.train.paged import first_layout_difference, pages_fingerprint
from angel_jax.train.protocol import StateMismatch, check_arrays, path_name
import models

log = logging.getLogger(__name__)

PARAMS_PREFIX = "params/"
"""Both engines name their parameter arrays under this prefix; everything else (optimizer state, counters) is
left unread."""


@dataclass(frozen=True)
class LoadedWeights:
    cfg: Config
    """The run's resolved config (its config.yaml)."""
    params: Any
    """The whole model's parameters as numpy arrays, in the family's `init` structure."""
    step: int
    """The training step the checkpoint holds."""


def load_params(run_dir: Path, step: int | None = None) -> LoadedWeights:
    """The parameters of the newest valid checkpoint of `run_dir` (or of `step`), from any engine.

    Raises CheckpointError naming the directory when it is not a run directory, holds no checkpoint (or not
    `step`), or holds only damaged ones; StateMismatch when the checkpoint does not fit the recorded config."""
    run_dir = Path(run_dir)
    cfg = run_config(run_dir)
    with CheckpointEngine(_read_options(cfg, run_dir)) as engine:
        committed = sorted(info.step for info in engine.list() if info.committed)
        shards = shard_steps(run_dir)  # newest first
        if not committed and not shards:
            raise CheckpointError(f"run directory {run_dir} has no checkpoint (looked in {engine.tier_roots()}): "
                                  "train it first, with checkpoint.every > 0 or to its last step")
        if step is not None and step not in committed and step not in shards:
            raise CheckpointError(f"run directory {run_dir} has no checkpoint of step {step} (its steps: "
                                  f"{', '.join(map(str, sorted(set(committed) | set(shards))))})", step=step)
        # Whole-state checkpoints, or the processes' shards, whichever holds the step asked for or the newest one
        # (a run that changed its number of processes has both kinds).
        whole = step in committed if step is not None else bool(committed) and committed[-1] >= (shards or [-1])[0]
        if whole:
            try:
                restored = engine.restore(step, select=lambda name: name.startswith(PARAMS_PREFIX))
            except CheckpointError as e:
                raise CheckpointError(f"run directory {run_dir}: {e}", step=step, stage="restore") from e
            at, arrays, meta = restored.step, restored.arrays, restored.meta
        else:  # every process checkpointed its own shards: the newest step (or `step`) assembled from them
            at, arrays, meta, _ = assemble_newest(run_dir, [step] if step is not None else shards,
                                                   cfg.checkpoint.keep)
    check_same_model(meta.get("config"), cfg, at)
    engine_meta = meta.get("engine") or {}
    where = f"{run_dir} step {at}"
    arrays = {k: v for k, v in arrays.items() if k.startswith(PARAMS_PREFIX)}  # (assembled: lazy, not yet read)
    if engine_meta.get("engine", "in_memory") == "paged":
        params = _unpack_pages(cfg, arrays, engine_meta, where)
    else:
        params = _from_leaves(cfg, arrays, where)
    return LoadedWeights(cfg=cfg, params=params, step=at)


def _read_options(cfg: Config, run_dir: Path) -> CheckpointOptions:
    """The run's checkpoint tiers, without a memory tier that holds another run's snapshots (a memory tier outlives
    its run directory; training removes a stale one when it starts, a reader must skip it)."""
    options = checkpoint_options(cfg, run_dir)
    memory = options.resolved_memory_dir()
    if memory.is_dir() and not owns_memory_tier(run_dir, memory):
        log.warning("the memory tier %s holds snapshots of another run than %s: reading the other tiers only",
                    memory, run_dir)
        # A directory that does not exist is an empty tier (nothing is created by reading).
        options = dataclasses.replace(options, memory_dir=run_dir / ".no-memory-tier")
    return options


def run_config(run_dir: Path) -> Config:
    """The resolved config a run recorded (<run_dir>/config.yaml); CheckpointError naming the directory when it is
    not a run directory."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"run directory {run_dir} does not exist")
    config_file = run_dir / "config.yaml"
    if not config_file.is_file():
        raise CheckpointError(f"{run_dir} is not a run directory: it has no config.yaml (the resolved config "
                              "every `angel-jax train` run writes)")
    try:
        return load_recorded_config(config_file)
    except ConfigError as e:
        raise CheckpointError(f"run directory {run_dir}: {e}") from e


def _from_leaves(cfg: Config, arrays: Mapping[str, Any], where: str) -> Any:
    """The in-memory engine's checkpoint: one array per leaf of the parameter tree."""
    _, abstract = models.get(cfg.model).abstract()
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    names = [PARAMS_PREFIX + path_name(path) for path, _ in leaves]
    check_arrays({n: (leaf.shape, leaf.dtype) for n, (_, leaf) in zip(names, leaves)}, arrays,
                 f"the parameters in {where}")
    return jax.tree_util.tree_unflatten(treedef, [np.array(arrays[n]) for n in names])


def _unpack_pages(cfg: Config, arrays: Mapping[str, Any], engine_meta: Mapping[str, Any], where: str) -> Any:
    """The paged engine's checkpoint: pages `params/<stage>/<k>`, unpacked stage by stage with the layout the
    engine built from the config, over the checkpoint's ranks (pages sharded over N devices are N ranks' pages
    end to end: `ShardedPageLayout`), checked against the checkpoint's fingerprint first."""
    if engine_meta.get("page_size") != cfg.memory.page_size:
        raise StateMismatch(f"{where}: the checkpoint's pages are {engine_meta.get('page_size')} B, the run's "
                            f"config says memory.page_size={cfg.memory.page_size}")
    ranks = engine_meta.get("ranks", 1)  # absent: written before pages were sharded, by one device
    if not isinstance(ranks, int) or ranks < 1:
        raise StateMismatch(f"{where}: the checkpoint's number of ranks is {ranks!r}, not a positive integer")
    layout = layout_over(params_layout(cfg), ranks)
    mine = {s.name: {"params": pages_fingerprint(layout, s.name)} for s in layout.stages}
    problem = first_layout_difference(mine, engine_meta.get("layout"), families=("params",))
    if problem:
        raise StateMismatch(f"{where}: the page layout rebuilt from the run's config differs from the "
                            f"checkpoint's: {problem}")
    expected = {f"{PARAMS_PREFIX}{s.name}/{k}": ((p.length,), p.dtype)
                for s in layout.stages for k, p in enumerate(s.pages)}
    check_arrays(expected, arrays, f"the parameter pages in {where}")
    staged = models.get(cfg.model)
    stage_params = [layout.stage(s.name).unpack(tuple(np.asarray(arrays[f"{PARAMS_PREFIX}{s.name}/{k}"])
                                                      for k in range(len(layout.stage(s.name).pages))))
                    for s in staged.stages]
    return jax.tree.map(np.asarray, staged.merge(stage_params))
