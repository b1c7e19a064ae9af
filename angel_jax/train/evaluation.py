"""Validation loss: a fixed set of held-out batches, run through the engine without changing its state.

    validation = ValidationSet.load(cfg, data_dir, shard_index=jax.process_index(), shard_count=jax.process_count())
    values = evaluate(engine, validation, tokenizer=cfg.data.tokenizer)   # eval/loss, eval/ppl, [eval/bpb], perf/eval_s

The batches are the first `train.eval_batches` global batches of the val split (the tail of the token stream that
`data.val_fraction` holds out) in the order `data.seed` gives it, read once: every evaluation, of every step and
after every resume, sees the same windows, so its numbers compare across steps and runs. Each process holds its
rows of each batch, as it does for training batches; the engine's loss of a global batch is the mean over its scored
targets (every target of text data; the responses' of instruction data, angel_jax/data/marks.py), and the batches'
losses are averaged weighted by their scored targets, so eval/loss is the mean over every scored validation token.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from angel_jax.data import shards as data_lib
from angel_jax.data import marks as token_marks
from angel_jax.config import Config, ConfigError
from angel_jax.train.protocol import TrainEngine

__all__ = ["ValidationSet", "eval_due", "eval_metrics", "evaluate"]


@dataclass(frozen=True)
class ValidationSet:
    batches: tuple[np.ndarray, ...]
    """This process's rows of each validation batch: int32 [batch_size // processes, seq_len + 1]."""

    @classmethod
    def load(cls, cfg: Config, data_dir: Path, *, shard_index: int = 0, shard_count: int = 1) -> ValidationSet:
        """The first `train.eval_batches` batches of the prepared val split; ConfigError naming the key to change
        when there is no val split or it holds fewer batches."""
        n, batch_size, window = cfg.train.eval_batches, cfg.train.batch_size, cfg.model.seq_len + 1
        meta = data_lib.load_meta(data_dir)
        tokens = sum(s["tokens"] for s in meta.get("val_shards", []))
        if tokens == 0:
            raise ConfigError(f"'train.eval_every'={cfg.train.eval_every} asks for a validation loss, but the "
                              f"prepared data in {data_dir} has no validation split: set 'data.val_fraction' "
                              "(e.g. 0.01) to hold out the tail of the token stream")
        have = tokens // window // batch_size
        if have < n:
            raise ConfigError(f"'train.eval_batches'={n} needs {n} x train.batch_size={batch_size} windows of "
                              f"model.seq_len+1={window} tokens, but the validation split in {data_dir} holds "
                              f"{tokens:,} tokens ({have} batches): raise 'data.val_fraction' "
                              f"(now {cfg.data.val_fraction}) or lower 'train.eval_batches'")
        it = data_lib.TokenIterator(data_dir, batch_size=batch_size, seq_len=cfg.model.seq_len, seed=cfg.data.seed,
                                    shard_index=shard_index, shard_count=shard_count, split="val")
        return cls(tuple(next(it) for _ in range(n)))


def eval_due(cfg: Config, step: int) -> bool:
    """Whether step `step` is followed by an evaluation: every train.eval_every steps, and after the last."""
    every = cfg.train.eval_every
    return bool(every) and (step % every == 0 or step == cfg.train.steps)


def eval_metrics(loss: float, tokenizer: str) -> dict[str, float]:
    """eval/loss (mean next-token cross-entropy, nats), eval/ppl = exp(loss), and for the byte tokenizer, where a
    token is a byte, eval/bpb = loss / ln 2 (bits per byte)."""
    out = {"eval/loss": loss, "eval/ppl": math.exp(loss) if loss < 700 else math.inf}  # exp overflows past ~709
    if tokenizer == "byte":
        out["eval/bpb"] = loss / math.log(2)
    return out


def evaluate(engine: TrainEngine, validation: ValidationSet, *, tokenizer: str) -> dict[str, float]:
    """The engine's mean loss over the validation batches, as metrics; perf/eval_s is the evaluation's wall time
    (the training loop keeps it out of every step's time)."""
    start = time.perf_counter()
    # Every batch is dispatched before any loss is read: the device runs them back to back.
    batches = [jax.make_array_from_process_local_data(engine.batch_sharding, rows) for rows in validation.batches]
    losses = [engine.eval_loss(batch) for batch in batches]
    counts = [_scored(batch) for batch in batches]  # of the global batch: every process's rows
    return {**eval_metrics(weighted_mean(jax.device_get(losses), jax.device_get(counts)), tokenizer),
            "perf/eval_s": time.perf_counter() - start}


@jax.jit
def _scored(batch: jax.Array) -> jax.Array:
    return jnp.sum(token_marks.scored(batch[:, 1:]))


def weighted_mean(losses: list, counts: list) -> float:
    """The mean of the batches' mean losses weighted by their scored targets: the mean over every scored target.
    Batches of text data, all fully scored and the same size, are averaged as they are (bit for bit what a plain
    mean gives)."""
    counts = [int(c) for c in counts]
    if len(set(counts)) == 1:
        return math.fsum(float(x) for x in losses) / len(losses)
    total = sum(counts)
    return math.fsum(float(x) * c for x, c in zip(losses, counts)) / total if total else 0.0
