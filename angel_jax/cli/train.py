"""`angel-jax train CONFIG [key=value ...]`: one training process, resuming from the run directory's newest checkpoint."""

from __future__ import annotations

import argparse
import logging
import sys

from angel_jax.config import dump_yaml, load_config


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        print(dump_yaml(cfg), end="")
        return 0
    from angel_jax.schedule.pinned_limit import configure_pinned_limit
    from angel_jax.tol.faults import FaultHooks
    from angel_jax.train.finished import finished_run
    from angel_jax.train.loop import persisted_text, train  # jax is imported only when needed: `--print-config` stays instant
    from angel_jax.train.preemption import Preempted

    if line := configure_pinned_limit(cfg):  # before jax starts a GPU client, which reads the limit once
        logging.getLogger("angel_jax.train").info("%s", line)
    if line := finished_run(cfg):  # as `launch` says it: nothing is built, nothing trained
        print(line)
        return 0
    faults = FaultHooks.from_env(rank=0, vocab_size=cfg.model.vocab_size)  # ANGEL_JAX_FAULTS: tests only
    try:
        result = train(cfg, hooks=[faults] if faults else [])
    except Preempted as e:  # not an error: the run saved and stopped as asked
        print(f"{e}; run directory {cfg.run_dir}", file=sys.stderr)
        return e.exit_code
    # The newest persisted step, always: a run whose checkpoints are all in RAM must not look finished and safe.
    if result.history:
        first, last = result.history[0], result.history[-1]
        trained = f"loss {first['loss']:.4f} (step {first['step']}) -> {last['loss']:.4f} (step {last['step']})"
    else:  # resumed at its last step: nothing left to train
        trained = "no step trained by this run"
    print(f"done: step {result.final_step}, {trained}; run directory {result.run_dir}; "
          f"{persisted_text(result.newest_persisted)}")
    return 0
