"""`angel-jax train CONFIG [key=value ...]`: one training process, resuming from the run directory's newest checkpoint."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import TYPE_CHECKING

from angel_jax.config import Config, dump_yaml, load_config

if TYPE_CHECKING:  # jax is imported only when a run needs it: `--print-config` stays instant
    from angel_jax.train.loop import TrainResult


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
    started = time.monotonic()
    try:
        result = train(cfg, hooks=[faults] if faults else [])
    except Preempted as e:  # not an error: the run saved and stopped as asked
        print(f"{e}; run directory {cfg.run_dir}", file=sys.stderr)
        return e.exit_code
    from angel_jax.memory import block_cache

    if (cache := block_cache.active()) is not None:
        logging.getLogger("angel_jax.train").info("%s", cache.describe())
    print(done_line(result, cfg, time.monotonic() - started, persisted_text(result.newest_persisted)))
    return 0


def done_line(result: TrainResult, cfg: Config, wall_s: float, persisted: str) -> str:
    """The run's last line: the loss it went from and to, the latest evaluation's loss, the tokens it trained and
    its wall time, every rollback (a run that went back must say so), and the newest persisted step, always (a
    run whose checkpoints are all in RAM must not look finished and safe)."""
    if not result.history:  # resumed at its last step: nothing left to train
        return (f"done: step {result.final_step}, no step trained by this run; run directory {result.run_dir}; "
                f"{persisted}")
    first, last = result.history[0], result.history[-1]
    parts = [f"loss {first['loss']:.4f} (step {first['step']}) -> {last['loss']:.4f} (step {last['step']})"]
    evaluated = [r for r in result.history if "eval/loss" in r]
    if evaluated:
        parts.append(f"eval loss {evaluated[-1]['eval/loss']:.4f} (step {evaluated[-1]['step']})")
    tokens = (result.final_step - result.start_step) * cfg.train.batch_size * cfg.model.seq_len
    parts.append(f"{_tokens(tokens)} tokens in {_wall(wall_s)}")
    if result.rollbacks:
        n = len(result.rollbacks)
        went = ", ".join(f"step {r['step']} -> {r['to_step']}" for r in result.rollbacks)
        parts.append(f"rolled back {'once' if n == 1 else f'{n} times'} ({went}; see events.jsonl)")
    return f"done: step {result.final_step}, {', '.join(parts)}; run directory {result.run_dir}; {persisted}"


def _tokens(n: int) -> str:
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def _wall(seconds: float) -> str:
    minutes, s = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {s:02d} s" if minutes else f"{seconds:.1f} s"
