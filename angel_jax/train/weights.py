"""A trained model's parameters, read from a run directory's checkpoints, whichever engine wrote them.

    weights = load_params(Path("runs/gpt_tiny"))          # the newest valid checkpoint (or step=N)
    weights.cfg, weights.step                             # the run's resolved config, the step
    weights.params                                        # numpy, in the family's `init` structure

What `TrainEngine.params()` returns at that step, from the checkpoint alone: no engine is built and nothing of
the optimizer state is read. The checkpoint manager's restore is used as training uses it (memory tier -> peer ->
persistent, a damaged copy skipped for the next), restricted to the parameter arrays, so only their bytes are read
and checksummed. A run whose processes checkpointed their own shards (train/checkpointing.py) is read from every
process's persistent tier, assembled (there every array is checksummed, the optimizer state's too). The two
engines name the parameters differently; train/state_formats.py reads either (`params/<path>` leaves, or
`params/<stage>/<k>` pages unpacked with the layout rebuilt from the config and checked against the checkpoint's).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from angel_jax.checkpoint import CheckpointManager, CheckpointError, CheckpointOptions
from angel_jax.config import Config, ConfigError, load_recorded_config
from angel_jax.train.checkpointing import assemble_newest, check_same_model, checkpoint_options, shard_steps
from angel_jax.train.state_formats import PARAMS_PREFIX, format_of
from angel_jax.train.tier_ownership import owns_memory_tier

log = logging.getLogger(__name__)


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
    with CheckpointManager(_read_options(cfg, run_dir)) as engine:
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
    params = format_of(engine_meta).params(cfg, arrays, engine_meta, where)
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
