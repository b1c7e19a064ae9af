"""The training loop: `setup` builds everything into one `Trainer`, `train` runs it top to bottom.

The loop knows nothing about where the model state lives: it drives a `TrainEngine` (in-memory reference or
paged, by `memory.mode`; see engines.py). Data parallel over every device of every process: each process feeds
its rows of the global batch. Metrics are fetched one step late (step t's numbers are read after step t+1 is
dispatched) so the host never stalls the device just to log. Checkpoints go through the checkpoint engine: the
loop blocks only for the memory-tier snapshot.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import numpy as np

from angel_jax import config as config_lib
from angel_jax import data as data_lib
from angel_jax.config import Config
from angel_jax.errors import AngelError
from angel_jax.train import metrics as metrics_lib
from angel_jax.train.checkpointing import TrainCheckpointer
from angel_jax.train.engines import TrainEngine, build_engine
from angel_jax.train.hooks import HookList, OnStep, TrainHooks
from angel_jax.train.report import memory_report
from models import gpt

log = logging.getLogger("angel_jax.train")


class TrainingDiverged(AngelError, RuntimeError):
    """Loss or gradient norm became NaN/Inf; the message names the step."""


@dataclass
class Trainer:
    """Everything the loop needs, built by `setup`."""

    cfg: Config
    run_dir: Path
    mesh: jax.sharding.Mesh
    engine: TrainEngine
    data: data_lib.TokenIterator
    checkpointer: TrainCheckpointer
    sinks: list[metrics_lib.MetricsSink]
    hooks: HookList
    start_step: int
    flops_per_token: float
    peak: metrics_lib.Peak
    is_primary: bool
    history: list[dict] = field(default_factory=list)
    carry: dict[str, float] = field(default_factory=dict)
    """Figures measured between steps (checkpoint stalls), written with the next logged record."""


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    final_step: int
    history: list[dict]
    """The metrics records written this run (every `log_every` steps, plus the first and the last)."""
    params: Any
    """The final parameters (numpy, models.gpt structure)."""


def data_dir_for(cfg: Config) -> Path:
    if cfg.data.dir:
        return Path(cfg.data.dir)
    source = "stdlib" if cfg.data.source == "stdlib" else Path(cfg.data.source).name.replace("*", "_")
    suffix = f"-{cfg.data.max_bytes}" if cfg.data.max_bytes else ""
    return Path("data") / f"{source}-{cfg.data.tokenizer}{suffix}"


def _data(cfg: Config) -> data_lib.TokenIterator:
    # Every process prepares nothing twice (a file lock inside), then reads its rows of each global batch.
    vocab = cfg.data.bpe_vocab_size if cfg.data.tokenizer == "bpe" else 256
    data_dir = data_dir_for(cfg)
    data_lib.ensure_prepared(data_dir, cfg.data.source, tokenizer=cfg.data.tokenizer, vocab_size=vocab,
                             max_bytes=cfg.data.max_bytes or None)
    data = data_lib.TokenIterator(data_dir, batch_size=cfg.train.batch_size, seq_len=cfg.model.seq_len,
                                  seed=cfg.data.seed, shard_index=jax.process_index(),
                                  shard_count=jax.process_count())
    if data.vocab_size > cfg.model.vocab_size:
        raise config_lib.ConfigError(
            f"'model.vocab_size'={cfg.model.vocab_size} is smaller than the tokenizer's {data.vocab_size}")
    return data


def setup(cfg: Config, hooks: HookList) -> Trainer:
    run_dir = cfg.run_dir
    is_primary = jax.process_index() == 0
    hooks.on_phase("setup", 0)
    run_dir.mkdir(parents=True, exist_ok=True)
    if is_primary:
        (run_dir / "config.yaml").write_text(config_lib.dump_yaml(cfg))
    devices = jax.devices()
    if cfg.train.batch_size % len(devices):
        raise config_lib.ConfigError(
            f"'train.batch_size'={cfg.train.batch_size} must be divisible by the number of devices ({len(devices)})")
    data = _data(cfg)
    # Auto axes: XLA's partitioner places the replicated-parameter / sharded-batch computation.
    mesh = jax.make_mesh((len(devices),), ("data",), devices=devices, axis_types=(jax.sharding.AxisType.Auto,))
    engine = build_engine(cfg, mesh)

    checkpointer = TrainCheckpointer(cfg, run_dir, primary=is_primary)
    start_step = 0
    if not cfg.train.resume:
        checkpointer.archive_existing()
    else:
        hooks.on_phase("restoring", 0)
        restored = checkpointer.restore_latest()
        if restored is not None:
            start_step, arrays, meta, tier = restored
            engine.load_state(arrays, meta.get("engine", {}))
            data.restore(data_lib.IteratorState.from_dict(meta["data"]))
            log.info("resumed from the checkpoint of step %d (%s tier)", start_step, tier)

    sinks: list[metrics_lib.MetricsSink] = []
    if is_primary:
        sinks.append(metrics_lib.JsonlSink(run_dir / cfg.logging.jsonl, resume_step=start_step))
        if cfg.logging.tensorboard:
            sinks.append(metrics_lib.TensorBoardSink(run_dir / "tb"))
    return Trainer(cfg=cfg, run_dir=run_dir, mesh=mesh, engine=engine, data=data, checkpointer=checkpointer,
                   sinks=sinks, hooks=hooks, start_step=start_step, flops_per_token=gpt.flops_per_token(cfg.model),
                   peak=metrics_lib.device_peak(devices[0]), is_primary=is_primary)


def train(cfg: Config, *, hooks: Sequence[TrainHooks] = (),
          on_step: Callable[[int, dict], None] | None = None) -> TrainResult:
    """Train `cfg` to `cfg.train.steps`, resuming from the run directory's newest valid checkpoint if any."""
    hook_list = HookList([*hooks, *([OnStep(on_step)] if on_step else [])])
    t: Trainer | None = None
    try:
        t = setup(cfg, hook_list)
        return _run(t)
    finally:
        # Also on an exception (divergence, Ctrl-C, a hook's fault): in-flight saves of good steps are committed
        # before the error propagates, and files and threads are released.
        if t is not None:
            _close(t)
        hook_list.close()


def _run(t: Trainer) -> TrainResult:
    cfg, steps = t.cfg, t.cfg.train.steps
    tokens_per_step = cfg.train.batch_size * cfg.model.seq_len
    if t.is_primary:
        print(memory_report(cfg, t.mesh, t.engine.memory_report()), flush=True)
    progress = _progress(t)
    t.hooks.on_phase("compiling", t.start_step)

    pending: tuple[int, dict] | None = None  # (step, its metrics still on the device)
    last_done = time.perf_counter()
    for step in range(t.start_step + 1, steps + 1):
        batch = jax.make_array_from_process_local_data(t.engine.batch_sharding, next(t.data))
        step_metrics = t.engine.step(batch)
        if pending is not None:
            last_done = _finish(t, pending, last_done, tokens_per_step, progress)
        pending = (step, step_metrics)
        if _checkpoint_due(cfg, step):
            _finish(t, pending, last_done, tokens_per_step, progress)  # never checkpoint a diverged state
            pending = None
            _save(t, step)
            last_done = time.perf_counter()  # the save's blocking part is not a training step
    if pending is not None:
        _finish(t, pending, last_done, tokens_per_step, progress)
    if progress is not None:
        progress.close()
    t.checkpointer.close()  # the final checkpoint is committed before train() returns
    _report_checkpoint_errors(t)
    t.hooks.on_phase("done", steps)
    return TrainResult(t.run_dir, steps, t.history, t.engine.params())


def _checkpoint_due(cfg: Config, step: int) -> bool:
    every = cfg.checkpoint.every
    return bool(every and step % every == 0) or (step == cfg.train.steps and cfg.checkpoint.at_end)


def _save(t: Trainer, step: int) -> None:
    t.hooks.on_phase("checkpointing", step)
    meta = {"data": t.data.state().to_dict(), "engine": t.engine.state_meta()}
    # Engines with immutable state let the checkpoint hold it and copy it in the background (no stall).
    release = threading.Event()
    keep_until = getattr(t.engine, "keep_until", None)
    hold = t.is_primary and keep_until is not None and keep_until(release)
    handle = t.checkpointer.save(step, t.engine.state_arrays(), meta, hold=hold, released=release)
    if handle is None:
        release.set()
    info = {"stall_s": handle.stall_s if handle else 0.0, "state": handle.state if handle else "not primary",
            "held": hold}
    t.carry["ckpt/stall_s"] = info["stall_s"]
    t.carry["ckpt/step"] = step
    t.hooks.on_checkpoint(step, info)
    t.hooks.on_phase("training", step)


def _report_checkpoint_errors(t: Trainer) -> None:
    """Background save failures (a full disk, ...) do not stop training; say so loudly, once each."""
    for error in t.checkpointer.poll_errors():
        log.warning("checkpoint save failed, training goes on (earlier checkpoints are intact): %s", error)


def _check_finite(step: int, values: dict[str, float]) -> None:
    bad = [k for k in ("loss", "grad_norm") if not math.isfinite(values[k])]
    if bad:
        raise TrainingDiverged(f"step {step}: {' and '.join(bad)} is {values[bad[0]]} (NaN/Inf); "
                               "stopping without saving this state")


def _finish(t: Trainer, pending: tuple[int, dict], last_done: float, tokens_per_step: int, progress: Any) -> float:
    """Wait for a dispatched step, check it, log it. Returns the time it completed."""
    step, device_metrics = pending
    values = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
    done = time.perf_counter()
    _check_finite(step, values)
    step_time = done - last_done
    if step == t.start_step + 1:
        values["perf/first_step_time"] = step_time  # includes compilation
        t.hooks.on_phase("training", step)
    else:
        values.update(metrics_lib.throughput(step_time, tokens_per_step, t.flops_per_token, t.peak,
                                             jax.device_count()))
        values["perf/mfu_is_estimate"] = float(t.peak.is_estimate)
    _report_checkpoint_errors(t)
    t.hooks.on_step(step, values)
    cfg = t.cfg
    if t.is_primary and (step % cfg.train.log_every == 0 or step == t.start_step + 1 or step == cfg.train.steps):
        values.update(t.carry)
        t.carry.clear()
        record = {k: round(v, 6) if isinstance(v, float) else v for k, v in values.items()}
        t.history.append({"step": step, **record})
        for sink in t.sinks:
            sink.write(step, record)
    if progress is not None:
        postfix = {"loss": f"{values['loss']:.3f}"}
        if "perf/tokens_per_s" in values:
            postfix["tok/s"] = f"{values['perf/tokens_per_s']:.0f}"
            postfix["mfu"] = f"{values['perf/mfu']:.1%}" + ("~" if t.peak.is_estimate else "")
        progress.set_postfix(postfix, refresh=False)
        progress.update(1)
    return done


def _close(t: Trainer) -> None:
    for closer in (t.checkpointer.close, *(s.close for s in t.sinks), t.engine.close):
        try:
            closer()
        except Exception as e:  # noqa: BLE001 - closing must not mask the error that got us here
            log.warning("while closing the run: %s", e)


def _progress(t: Trainer) -> Any:
    if not (t.is_primary and t.cfg.train.progress):
        return None
    from tqdm import tqdm

    return tqdm(total=t.cfg.train.steps, initial=t.start_step, desc=t.cfg.name, unit="step", dynamic_ncols=True)
