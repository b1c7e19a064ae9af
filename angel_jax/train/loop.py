"""The reference training loop: `setup` builds everything into one `Trainer`, `train` runs it top to bottom.

Data parallel over every device of every process: the batch is sharded on the mesh's 'data' axis, parameters and
optimizer state are replicated. Metrics are fetched one step late (step t's numbers are read after step t+1 is
dispatched) so the host never stalls the device just to log.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from angel_jax import config as config_lib
from angel_jax import data as data_lib
from angel_jax.config import Config
from angel_jax.errors import AngelError
from angel_jax.optim import make_optimizer
from angel_jax.train import metrics as metrics_lib
from angel_jax.train.checkpointing import ReferenceCheckpointer, abstract_like
from angel_jax.train.report import memory_report
from angel_jax.train.step import TrainState, init_state, make_train_step
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
    state: TrainState
    step_fn: Callable[[TrainState, jax.Array], tuple[TrainState, dict]]
    data: data_lib.TokenIterator
    batch_sharding: NamedSharding
    checkpointer: ReferenceCheckpointer
    sinks: list[metrics_lib.MetricsSink]
    start_step: int
    flops_per_token: float
    peak: metrics_lib.Peak
    is_primary: bool
    history: list[dict] = field(default_factory=list)


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    final_step: int
    history: list[dict]
    """The metrics records written this run (every `log_every` steps, plus step 1 and the last)."""
    state: TrainState


def data_dir_for(cfg: Config) -> Path:
    if cfg.data.dir:
        return Path(cfg.data.dir)
    source = "stdlib" if cfg.data.source == "stdlib" else Path(cfg.data.source).name.replace("*", "_")
    suffix = f"-{cfg.data.max_bytes}" if cfg.data.max_bytes else ""
    return Path("data") / f"{source}-{cfg.data.tokenizer}{suffix}"


def setup(cfg: Config) -> Trainer:
    run_dir = cfg.run_dir
    is_primary = jax.process_index() == 0
    run_dir.mkdir(parents=True, exist_ok=True)
    if is_primary:
        (run_dir / "config.yaml").write_text(config_lib.dump_yaml(cfg))

    # Data: every process prepares nothing twice (a file lock inside), then reads its slice of each global batch.
    vocab = cfg.data.bpe_vocab_size if cfg.data.tokenizer == "bpe" else 256
    data_dir = data_dir_for(cfg)
    data_lib.ensure_prepared(data_dir, cfg.data.source, tokenizer=cfg.data.tokenizer, vocab_size=vocab,
                             max_bytes=cfg.data.max_bytes or None)
    devices = jax.devices()
    if cfg.train.batch_size % len(devices):
        raise config_lib.ConfigError(
            f"'train.batch_size'={cfg.train.batch_size} must be divisible by the number of devices ({len(devices)})")
    data = data_lib.TokenIterator(data_dir, batch_size=cfg.train.batch_size, seq_len=cfg.model.seq_len,
                                  seed=cfg.data.seed, shard_index=jax.process_index(),
                                  shard_count=jax.process_count())
    if data.vocab_size > cfg.model.vocab_size:
        raise config_lib.ConfigError(
            f"'model.vocab_size'={cfg.model.vocab_size} is smaller than the tokenizer's {data.vocab_size}")

    # Model, optimizer, state: created directly with their final (replicated) sharding.
    # Auto axes: XLA's partitioner places the replicated-parameter / sharded-batch computation (jax's default
    # Explicit axes would ask every gather for an out_sharding).
    mesh = jax.make_mesh((len(devices),), ("data",), devices=devices, axis_types=(jax.sharding.AxisType.Auto,))
    replicated = NamedSharding(mesh, P())
    tx, schedule = make_optimizer(cfg.optimizer, cfg.train.steps)
    graphdef, _ = gpt.abstract_params(cfg.model)

    def make_state() -> TrainState:
        return init_state(gpt.init(cfg.model, cfg.train.seed)[1], tx)

    state = jax.jit(make_state, out_shardings=replicated)()
    step_fn = jax.jit(make_train_step(graphdef, tx, schedule), donate_argnums=0)

    checkpointer = ReferenceCheckpointer(run_dir / "checkpoints", keep=cfg.checkpoint.keep, primary=is_primary)
    start_step = 0
    latest = checkpointer.latest_step() if cfg.train.resume else None
    if latest is not None:
        state, data_state = checkpointer.restore(latest, abstract_like(state))
        data.restore(data_lib.IteratorState.from_dict(data_state))
        start_step = latest
        log.info("resumed from the checkpoint of step %d in %s", latest, checkpointer.directory)

    sinks: list[metrics_lib.MetricsSink] = []
    if is_primary:
        sinks.append(metrics_lib.JsonlSink(run_dir / cfg.logging.jsonl, resume_step=start_step))
        if cfg.logging.tensorboard:
            sinks.append(metrics_lib.TensorBoardSink(run_dir / "tb"))
    return Trainer(cfg=cfg, run_dir=run_dir, mesh=mesh, state=state, step_fn=step_fn, data=data,
                   batch_sharding=NamedSharding(mesh, P("data")), checkpointer=checkpointer, sinks=sinks,
                   start_step=start_step, flops_per_token=gpt.flops_per_token(cfg.model),
                   peak=metrics_lib.device_peak(devices[0]), is_primary=is_primary)


def _device_batch(t: Trainer, local: np.ndarray) -> jax.Array:
    return jax.make_array_from_process_local_data(t.batch_sharding, local)


def _check_finite(step: int, values: dict[str, float]) -> None:
    bad = [k for k in ("loss", "grad_norm") if not math.isfinite(values[k])]
    if bad:
        raise TrainingDiverged(f"step {step}: {' and '.join(bad)} is {values[bad[0]]} (NaN/Inf); "
                               "stopping without saving this state")


def _checkpoint_due(cfg: Config, step: int) -> bool:
    every = cfg.checkpoint.every
    return bool(every and step % every == 0) or (step == cfg.train.steps and cfg.checkpoint.at_end)


def train(cfg: Config, *, on_step: Callable[[int, dict], None] | None = None) -> TrainResult:
    """Train `cfg` to `cfg.train.steps`, resuming from the run directory's newest checkpoint if any."""
    t = setup(cfg)
    steps = cfg.train.steps
    tokens_per_step = cfg.train.batch_size * cfg.model.seq_len
    if t.is_primary:
        print(memory_report(t.state, cfg, t.mesh), flush=True)
    progress = _progress(t)

    pending: tuple[int, dict] | None = None  # (step, its metrics still on the device)
    last_done = time.perf_counter()
    for step in range(t.start_step + 1, steps + 1):
        batch = _device_batch(t, next(t.data))
        t.state, step_metrics = t.step_fn(t.state, batch)
        if pending is not None:
            last_done = _finish(t, pending, last_done, tokens_per_step, progress, on_step)
        pending = (step, step_metrics)
        if _checkpoint_due(cfg, step):
            _finish(t, pending, last_done, tokens_per_step, progress, on_step)  # never checkpoint a diverged state
            pending = None
            t.checkpointer.save(step, t.state, t.data.state().to_dict())
            last_done = time.perf_counter()  # the save's blocking part is not a training step
    if pending is not None:
        _finish(t, pending, last_done, tokens_per_step, progress, on_step)
    t.checkpointer.close()
    for sink in t.sinks:
        sink.close()
    if progress is not None:
        progress.close()
    return TrainResult(t.run_dir, steps, t.history, t.state)


def _finish(t: Trainer, pending: tuple[int, dict], last_done: float, tokens_per_step: int,
            progress: Any, on_step: Callable[[int, dict], None] | None) -> float:
    """Wait for a dispatched step, check it, log it. Returns the time it completed."""
    step, device_metrics = pending
    values = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
    done = time.perf_counter()
    _check_finite(step, values)
    step_time = done - last_done
    if step == t.start_step + 1:
        values["perf/first_step_time"] = step_time  # includes compilation
    else:
        values.update(metrics_lib.throughput(step_time, tokens_per_step, t.flops_per_token, t.peak,
                                             jax.device_count()))
        values["perf/mfu_is_estimate"] = float(t.peak.is_estimate)
    if on_step is not None:
        on_step(step, values)
    cfg = t.cfg
    if t.is_primary and (step % cfg.train.log_every == 0 or step == t.start_step + 1 or step == cfg.train.steps):
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


def _progress(t: Trainer) -> Any:
    if not (t.is_primary and t.cfg.train.progress):
        return None
    from tqdm import tqdm

    return tqdm(total=t.cfg.train.steps, initial=t.start_step, desc=t.cfg.name, unit="step", dynamic_ncols=True)
