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

    with open_stages(Path("runs/big")) as weights:        # a paged run larger than RAM: one stage at a time
        for i in range(n_stages):
            params_i = weights.read(i)                    # only stage i's pages are read (and checksummed)

A paged checkpoint's stages are restored one at a time, each restricted to its own pages, so reading a model
larger than host memory holds one stage; the step is the newest whose first stage verifies (or `step`), and every
later stage is read from that same step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import jax

from angel_jax.checkpoint import CheckpointManager, CheckpointError, CheckpointOptions
from angel_jax.checkpoint.records import Restored
from angel_jax.config import Config, ConfigError, load_recorded_config
from angel_jax.schedule.blueprint import params_layout
from angel_jax.train.checkpointing import assemble_newest, check_same_model, checkpoint_options, shard_steps
from angel_jax.train.state_formats import PARAMS_PREFIX, Pages, format_of, stage_page_prefix
from angel_jax.train.tier_ownership import owns_memory_tier
import models

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedWeights:
    cfg: Config
    """The run's resolved config (its config.yaml)."""
    params: Any
    """The whole model's parameters as numpy arrays, in the family's `init` structure."""
    step: int
    """The training step the checkpoint holds."""


@dataclass(frozen=True)
class StageWeights:
    cfg: Config
    """The run's resolved config (its config.yaml)."""
    step: int
    """The training step the checkpoint holds."""
    read: Callable[[int], Any]
    """Stage i's parameters (numpy, in the structure of the family's `init_stage`), read when called."""


def load_params(run_dir: Path, step: int | None = None) -> LoadedWeights:
    """The parameters of the newest valid checkpoint of `run_dir` (or of `step`), from any engine.

    Raises CheckpointError naming the directory when it is not a run directory, holds no checkpoint (or not
    `step`), or holds only damaged ones; StateMismatch when the checkpoint does not fit the recorded config."""
    run_dir = Path(run_dir)
    cfg = run_config(run_dir)
    with CheckpointManager(_read_options(cfg, run_dir)) as engine:
        at, arrays, meta = _read_params(engine, cfg, run_dir, step)
    engine_meta = meta.get("engine") or {}
    params = format_of(engine_meta).params(cfg, arrays, engine_meta, f"{run_dir} step {at}")
    return LoadedWeights(cfg=cfg, params=params, step=at)


Admit = Callable[[tuple[int, ...], bool], None]
"""Called with (held_bytes, streamed) of the checkpoint about to be read, before any parameter is: may refuse."""


@contextlib.contextmanager
def open_stages(run_dir: Path, step: int | None = None, admit: Admit | None = None) -> Iterator[StageWeights]:
    """The parameters of the newest valid checkpoint of `run_dir` (or of `step`), to read a stage at a time while
    the context is open: a paged checkpoint's stages each from its own pages alone (restored, and checksummed, as
    they are read); the in-memory engine's leaves whole, as `load_params` reads them, then split. `admit` sees what
    reading will hold before any parameter is read (for the processes' shards of a multi-process run, after they
    are assembled and verified by `assemble_newest`, which reads them as the persistent tier does: whole, or in
    groups when they exceed half the RAM). The same errors as `load_params`; a later stage damaged in every copy
    of the step is a CheckpointError naming the stage."""
    run_dir = Path(run_dir)
    cfg = run_config(run_dir)
    admit = admit or (lambda held, streamed: None)
    with CheckpointManager(_read_options(cfg, run_dir)) as engine:
        if _whole_checkpoint(engine, run_dir, step):
            # The index alone (no array is read) says which engine wrote the checkpoint.
            probe = _restore(engine, run_dir, step, select=lambda name: False)
            paged = format_of(probe.meta.get("engine") or {}).engine == Pages.engine
            admit(held_bytes(cfg, paged), paged)
            if paged:
                yield _paged_stages(engine, cfg, run_dir, step)
                return
            at, arrays, meta = _read_params(engine, cfg, run_dir, step)
        else:  # the processes' shards, verified as they were assembled, handed over as lazy arrays
            at, arrays, meta = _read_params(engine, cfg, run_dir, step)
            paged = format_of(meta.get("engine") or {}).engine == Pages.engine
            admit(held_bytes(cfg, paged), paged)
        yield _stages_of(cfg, at, arrays, meta, f"{run_dir} step {at}")


def held_bytes(cfg: Config, paged: bool) -> tuple[int, ...]:
    """The most host bytes reading each stage holds at once, from the config's shapes alone: a paged checkpoint's
    pages of the stage and the leaves unpacked from them (a copy); parameters read whole, all of them."""
    if paged:
        layout = params_layout(cfg)
        return tuple(2 * layout.stage(s.name).nbytes for s in layout.stages)
    staged = models.get(cfg.model)
    total = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(staged.abstract()[1]))
    return (total,) * len(staged.stages)


def _whole_checkpoint(engine: CheckpointManager, run_dir: Path, step: int | None) -> bool:
    """Whether the step to read is a whole-state checkpoint (True) or the processes' shards of one (False): the
    kind that holds the step asked for, or the newest step (a run that changed its number of processes has
    both). CheckpointError naming the directory when there is no checkpoint, or none of `step`."""
    committed = sorted(info.step for info in engine.list() if info.committed)
    shards = shard_steps(run_dir)  # newest first
    if not committed and not shards:
        raise CheckpointError(f"run directory {run_dir} has no checkpoint (looked in {engine.tier_roots()}): "
                              "train it first, with checkpoint.every > 0 or to its last step")
    if step is not None and step not in committed and step not in shards:
        raise CheckpointError(f"run directory {run_dir} has no checkpoint of step {step} (its steps: "
                              f"{', '.join(map(str, sorted(set(committed) | set(shards))))})", step=step)
    return step in committed if step is not None else bool(committed) and committed[-1] >= (shards or [-1])[0]


def _restore(engine: CheckpointManager, run_dir: Path, step: int | None, select: Callable[[str], bool],
             what: str = "") -> Restored:
    try:
        return engine.restore(step, select=select)
    except CheckpointError as e:
        raise CheckpointError(f"run directory {run_dir}: {what}{e}", step=step, stage="restore") from e


def _read_params(engine: CheckpointManager, cfg: Config, run_dir: Path, step: int | None
                 ) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """(step, the `params/` arrays, meta) of the checkpoint to read, checked to hold the config's model."""
    if _whole_checkpoint(engine, run_dir, step):
        restored = _restore(engine, run_dir, step, select=lambda name: name.startswith(PARAMS_PREFIX))
        at, arrays, meta = restored.step, restored.arrays, restored.meta
    else:  # every process checkpointed its own shards: the newest step (or `step`) assembled from them
        shards = shard_steps(run_dir)
        at, arrays, meta, _ = assemble_newest(run_dir, [step] if step is not None else shards, cfg.checkpoint.keep)
    check_same_model(meta.get("config"), cfg, at)
    arrays = {k: v for k, v in arrays.items() if k.startswith(PARAMS_PREFIX)}  # (assembled: lazy, not yet read)
    return at, arrays, meta


def _paged_stages(engine: CheckpointManager, cfg: Config, run_dir: Path, step: int | None) -> StageWeights:
    """A paged whole-state checkpoint read a stage at a time, each stage restored alone from the tiers: the step
    is the newest whose first stage verifies (or `step`), and every later stage comes from that step."""
    names = [s.name for s in models.get(cfg.model).stages]

    def only(stage: str) -> Callable[[str], bool]:
        prefix = stage_page_prefix(stage)
        return lambda name: name.startswith(prefix)

    first = _restore(engine, run_dir, step, only(names[0]))
    at, meta = first.step, first.meta
    check_same_model(meta.get("config"), cfg, at)
    where = f"{run_dir} step {at}"
    fmt = format_of(meta.get("engine") or {})
    if fmt.engine != Pages.engine:  # the newest step's first stage was damaged, and an older step is another kind
        raise CheckpointError(f"{where} was written by the {fmt.engine} engine, the newer checkpoints by the paged "
                              f"one (whose first stage did not verify): read it with step {at} (--step {at})",
                              step=at, stage="restore")
    layout = fmt.params_layout(cfg, meta.get("engine") or {}, where)
    waiting = {0: first.arrays}  # the first stage's pages, already read
    del first

    def read(i: int) -> Any:
        arrays = waiting.pop(i) if i in waiting else \
            _restore(engine, run_dir, at, only(names[i]), f"the parameters of stage {names[i]!r}: ").arrays
        return fmt.stage_params(layout, names[i], arrays, where)

    return StageWeights(cfg=cfg, step=at, read=read)


def _stages_of(cfg: Config, at: int, arrays: dict[str, Any], meta: dict[str, Any], where: str) -> StageWeights:
    """The stages of parameters already restored: pages (the processes' shards, assembled lazily) unpacked a
    stage at a time; the in-memory engine's leaves, read whole, split."""
    engine_meta = meta.get("engine") or {}
    fmt = format_of(engine_meta)
    staged = models.get(cfg.model)
    names = [s.name for s in staged.stages]
    if fmt.engine == Pages.engine:
        layout = fmt.params_layout(cfg, engine_meta, where)
        return StageWeights(cfg=cfg, step=at, read=lambda i: fmt.stage_params(layout, names[i], arrays, where))
    params = fmt.params(cfg, arrays, engine_meta, where)
    return StageWeights(cfg=cfg, step=at, read=staged.split(params).__getitem__)


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
