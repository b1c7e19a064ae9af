"""A run directory that already holds the run to its end: `train` and `launch` say so in one line and start nothing.

Resuming such a run would build the model, restore the checkpoint, train 0 steps and report a run that did nothing
(under `launch`: a goodput of 0% and a job that "succeeded"). The check reads only the persistent tier's listing
(no array, no JAX device): the newest step committed there, of the whole state (`checkpoints/<k>/`) or of every
process's shards (`checkpoints/process_<p>/<k>/`). A final step that is only in the memory tier is not finished:
the resume persists it (loop.py), so a reboot cannot lose it.
"""

from __future__ import annotations

from angel_jax.checkpoint import CheckpointManager
from angel_jax.config import Config
from angel_jax.train.checkpointing import checkpoint_options, shard_steps


def newest_persisted_step(cfg: Config) -> int | None:
    """The newest step committed in the run directory's persistent tier, of either layout; None if none."""
    root = cfg.run_dir / "checkpoints"
    if not root.is_dir():
        return None
    with CheckpointManager(checkpoint_options(cfg, cfg.run_dir)) as engine:
        whole = [i.step for i in engine.list()
                 if "persistent" in i.tiers and i.tiers["persistent"].state == "persisted"]
    return max(whole + shard_steps(cfg.run_dir)[:1], default=None)


def finished_run(cfg: Config) -> str | None:
    """The line to print instead of resuming `cfg`'s run when its run directory holds a run at or past
    train.steps (and train.resume asks to resume it); None when there is something to train."""
    steps = cfg.train.steps
    if not cfg.train.resume or steps <= 0:
        return None
    newest = newest_persisted_step(cfg)
    if newest is None or newest < steps:
        return None
    where = f"step {newest} of {steps}" if newest == steps else f"step {newest}, past train.steps={steps}"
    return (f"{cfg.run_dir} holds a finished run ({where}): nothing to train. To train more, raise train.steps "
            f"(e.g. train.steps={max(newest, steps) * 2}); to start over, train.resume=false (the old checkpoints are "
            "moved aside) or another train.run_dir")
