"""The training loop: `setup` builds everything into one `Trainer`, `train` runs it top to bottom.

The loop knows nothing about where the model state lives: it drives a `TrainEngine` (in-memory reference or
paged, by `memory.mode`; see engines.py). Data parallel over every device of every process, on a ('data',
'fsdp') mesh (`mesh.*`: the in-memory engine shards its state over 'fsdp'): each process feeds its rows of the
global batch. Metrics are fetched one step late (step t's numbers are read after step t+1 is
dispatched) so the host never stalls the device just to log. Checkpoints go through the checkpoint manager: the
loop blocks only for handing the state over. A run whose checkpoints stop reaching the persistent tier
(`checkpoint.max_persist_failures` failed persists in a row) stops at its next checkpoint, or at the end, with
PersistenceFailed, its memory-tier snapshots kept: training on with every checkpoint in RAM only would pretend
a durability the run does not have. Every step's figures go through the anomaly monitor (anomaly.py),
whose guard drops bad updates on the device and whose verdict may roll the run back to its last checkpoint.
Every `train.eval_every` steps (and after the last) the engine evaluates the loss of a fixed set of validation
batches (evaluation.py); that time is reported as perf/eval_s and kept out of the steps' times.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import numpy as np

from angel_jax import config as config_lib
from angel_jax.data import shards as data_lib
from angel_jax.data import hf_tokenizer as tokenizers_hf
from angel_jax.data import instructions as instruction_data
from angel_jax.data import identity as data_identity
from angel_jax.data.sources import resolve_sources
from angel_jax.checkpoint.manager import PersistenceFailed, PersistStreak
from angel_jax.config import Config
from angel_jax.errors import EXIT_EXCLUDE, EXIT_RESTART
from angel_jax.multihost import from_any, from_primary, node_name
from angel_jax.phases import Phase
from angel_jax.schedule.budgets import gather_room
from angel_jax.tee.actions import Action
from angel_jax.tee.events import EventLog
from angel_jax.train import metrics as metrics_lib
from angel_jax.train.anomaly import AnomalyMonitor, RestartRequested, TrainingDiverged, Verdict
from angel_jax.train.checkpointing import TrainCheckpointer, check_processes_agree, check_same_run
from angel_jax.train.curves import loss_curve_hooks
from angel_jax.train.engines import TrainEngine, build_engine, refuse_beyond_reach
from angel_jax.train.evaluation import ValidationSet, eval_due, evaluate
from angel_jax.train.hooks import HookList, OnStep, TrainHooks
from angel_jax.train.preemption import Preempted, StopSignals, SyncedStop, stop_source
from angel_jax.train.progress import progress_display
from angel_jax.train.report import memory_report
from angel_jax.train.rundir import lock_run_dir
from angel_jax.train.sharding import make_mesh
import models

log = logging.getLogger("angel_jax.train")

__all__ = ["TrainResult", "Trainer", "TrainingDiverged", "RestartRequested", "setup", "train"]


@dataclass
class Trainer:
    """Everything the loop needs, built by `setup`."""

    cfg: Config
    run_dir: Path
    mesh: jax.sharding.Mesh
    engine: TrainEngine
    data: data_lib.TokenIterator
    checkpointer: TrainCheckpointer
    monitor: AnomalyMonitor
    events: EventLog
    sinks: list[metrics_lib.MetricsSink]
    hooks: HookList
    start_step: int
    flops_per_token: float
    peak: metrics_lib.Peak
    is_primary: bool
    validation: ValidationSet | None = None
    """The fixed validation batches (train.eval_every > 0)."""
    skips: list[list[int]] = field(default_factory=list)
    """Global batch index ranges [first, last] this run will never train on (config + rollbacks)."""
    trail: dict[int, tuple[int, dict]] = field(default_factory=dict)
    """step -> (its batch index, the data iterator's state after its batch), since the last checkpoint."""
    history: list[dict] = field(default_factory=list)
    carry: dict[str, float] = field(default_factory=dict)
    """Figures measured between steps (checkpoint stalls), written with the next logged record."""
    progress: Any = None
    last_eval_loss: float | None = None
    """The latest evaluation's loss, shown in the progress bar until the next."""
    stop: StopSignals | SyncedStop = field(default_factory=lambda: StopSignals(enabled=False))
    """A SIGTERM or SIGINT received: the loop saves the step in flight and stops."""
    window: metrics_lib.StepWindow = field(default_factory=metrics_lib.StepWindow)
    """The recent steps' intervals the `perf/` figures average over (restarted after every pause)."""
    rollbacks: list[dict] = field(default_factory=list)
    """This run's rollbacks: {"step": the bad step, "to_step": the step it went back to}."""


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    final_step: int
    history: list[dict]
    """The metrics records written this run (every `log_every` steps, plus the first and the last)."""
    params: Any
    """The final parameters (numpy, the model's structure); None when they would take more than half of the RAM
    available (a paged model larger than memory: read them from its checkpoint instead)."""
    newest_persisted: int | None = None
    """The newest step committed in the persistent tier when the run ended (this run's or an earlier one's); None
    when there is none: the run's state is then only in the memory tier, which a reboot loses."""
    start_step: int = 0
    """The step this run started after (the checkpoint it resumed, else 0)."""
    rollbacks: tuple[dict, ...] = ()
    """This run's rollbacks, in order: {"step": the bad step, "to_step": the step it went back to}."""


def persisted_text(step: int | None) -> str:
    """How the run's last lines name its newest persisted checkpoint."""
    return f"newest persisted checkpoint: step {step}" if step is not None else "no checkpoint persisted"


def data_dir_for(cfg: Config) -> Path:
    if cfg.data.dir:
        return Path(cfg.data.dir)
    source = "stdlib" if cfg.data.source == "stdlib" else Path(cfg.data.source).name.replace("*", "_")
    suffix = f"-{cfg.data.max_bytes}" if cfg.data.max_bytes else ""
    # Another split is other training data: its own directory, so configs with and without one never re-prepare
    # each other's.
    suffix += f"-val{cfg.data.val_fraction:g}" if cfg.data.val_fraction else ""
    if cfg.data.format == "instruction":  # rows of seq_len + 1, packed or padded: data of its own
        suffix = f"-{'pack' if cfg.data.pack else 'pad'}{cfg.model.seq_len + 1}{suffix}"
    return Path("data") / f"{source}-{_tokenizer_name(cfg)}{suffix}"


def _tokenizer_name(cfg: Config) -> str:
    # A Hugging Face tokenizer is named by its fingerprint: another tokenizer never finds this one's shards.
    if cfg.data.tokenizer != "hf":
        return cfg.data.tokenizer
    directory, key = tokenizers_hf.tokenizer_dir(cfg)
    return f"hf-{tokenizers_hf.fingerprint(directory, key)[:12]}"


def _data(cfg: Config) -> tuple[data_lib.TokenIterator, ValidationSet | None]:
    # Every process prepares nothing twice (a file lock inside), then reads its rows of each global batch.
    vocab = cfg.data.bpe_vocab_size if cfg.data.tokenizer == "bpe" else 256
    tokenizer_path = None
    if cfg.data.tokenizer == "hf":  # checked before a corpus is tokenized for a model that cannot take it
        tokenizers_hf.load_for(cfg)
        tokenizer_path = tokenizers_hf.tokenizer_dir(cfg)[0]
    data_dir = data_dir_for(cfg)
    if cfg.data.format == "instruction":
        rows = instruction_data.Rows(cfg.model.seq_len + 1, cfg.data.pack, cfg.data.prompt_key, cfg.data.response_key)
        instruction_data.ensure_prepared(data_dir, cfg.data.source, rows, tokenizer=cfg.data.tokenizer,
                                         vocab_size=vocab, val_fraction=cfg.data.val_fraction or None,
                                         tokenizer_path=tokenizer_path)
    else:
        data_lib.ensure_prepared(data_dir, cfg.data.source, tokenizer=cfg.data.tokenizer, vocab_size=vocab,
                                 max_bytes=cfg.data.max_bytes or None, val_fraction=cfg.data.val_fraction or None,
                                 text_key=cfg.data.text_key, allow_binary=cfg.data.allow_binary,
                                 tokenizer_path=tokenizer_path)
    shard = {"shard_index": jax.process_index(), "shard_count": jax.process_count()}
    data = data_lib.TokenIterator(data_dir, batch_size=cfg.train.batch_size, seq_len=cfg.model.seq_len,
                                  seed=cfg.data.seed, **shard)
    if data.vocab_size > cfg.model.vocab_size:
        raise config_lib.ConfigError(
            f"'model.vocab_size'={cfg.model.vocab_size} is smaller than the tokenizer's {data.vocab_size}")
    validation = ValidationSet.load(cfg, data_dir, **shard) if cfg.train.eval_every else None
    return data, validation


def setup(cfg: Config, hooks: HookList) -> Trainer:
    run_dir = cfg.run_dir
    is_primary = jax.process_index() == 0
    hooks.on_phase(Phase.SETUP, 0)
    if is_primary:
        metrics_lib.import_wandb(cfg.logging)  # a missing optional package fails now, not after the model is built
    run_dir.mkdir(parents=True, exist_ok=True)
    devices = jax.devices()
    if cfg.train.batch_size % len(devices):
        raise config_lib.ConfigError(
            f"'train.batch_size'={cfg.train.batch_size} must be divisible by the number of devices ({len(devices)})")
    cfg.train.micro_batches(len(devices))  # a batch that does not split into micro-batches per device is refused
    mesh = make_mesh(cfg.mesh, devices)  # ('data', 'fsdp'): replicas x shards of the training state
    refuse_beyond_reach(cfg)  # a model no tier could hold fails at once, from its config, before anything is built
    models.check_init_from(cfg.model)  # a wrong model.init_from fails before the data is prepared
    data, validation = _data(cfg)
    engine = build_engine(cfg, mesh)
    events = EventLog(run_dir / "events.jsonl", source=f"rank{jax.process_index()}")
    monitor = AnomalyMonitor(cfg.anomaly, rank=jax.process_index(), primary=is_primary, events=events)
    skips = [list(r) for r in cfg.data.skip_batches]

    # What this run trains on, recorded in its checkpoints and compared at resume (data for a legacy directory
    # whose meta.json lacks its content is hashed from the sources it was prepared from).
    identity = data_identity.identity_of(data_dir_for(cfg), data.meta, lambda: resolve_sources(cfg.data.source))
    check_processes_agree(identity)
    checkpointer = TrainCheckpointer(cfg, run_dir, primary=is_primary, per_process=engine.checkpoints_per_process,
                                     identity=identity, events=events)
    start_step = 0
    if not cfg.train.resume:
        checkpointer.archive_existing()
    else:
        hooks.on_phase(Phase.RESTORING, 0)
        began = time.monotonic()
        restored = checkpointer.restore_latest()
        if restored is not None:
            start_step, arrays, meta, tier = restored
            if jax.process_count() > 1:  # each process's own tier (a rank moved to a spare reads the peer copy)
                events.write("restored", step=start_step, tier=tier, node=node_name(),
                             read_s=round(time.monotonic() - began, 4))
            check_same_run(meta, cfg, identity, start_step)
            engine.load_state(arrays, meta.get("engine", {}))
            data.restore(data_lib.IteratorState.from_dict(meta["data"]))
            skips += [r for r in meta.get("data_skips", []) if r not in skips]
            if "tee" in meta:
                monitor.load_state_dict(meta["tee"])
            log.info("resumed from the checkpoint of step %d (%s tier)", start_step, tier)
            if is_primary:
                events.write("resumed", step=start_step, tier=tier)
    # After archive_existing, which replaces the checkpointer's engine.
    checkpointer.engine.stop_persisting_after(cfg.checkpoint.max_persist_failures)

    if is_primary:  # only now: a run refused above (another model, damaged checkpoints) leaves the old config
        (run_dir / "config.yaml").write_text(config_lib.dump_yaml(cfg))
    sinks = metrics_lib.open_sinks(cfg, run_dir, start_step=start_step) if is_primary else []
    return Trainer(cfg=cfg, run_dir=run_dir, mesh=mesh, engine=engine, data=data, checkpointer=checkpointer,
                   monitor=monitor, events=events, sinks=sinks, hooks=hooks, start_step=start_step,
                   flops_per_token=models.get(cfg.model).flops_per_token, peak=metrics_lib.device_peak(devices[0]),
                   is_primary=is_primary, validation=validation, skips=skips)


def train(cfg: Config, *, hooks: Sequence[TrainHooks] = (),
          on_step: Callable[[int, dict], None] | None = None) -> TrainResult:
    """Train `cfg` to `cfg.train.steps`, resuming from the run directory's newest valid checkpoint if any.

    On SIGTERM or SIGINT (with checkpoint.on_signal) the step in flight is finished and saved, and `Preempted` is
    raised once the checkpoint is committed. In a `jax.distributed` job, SIGTERM to any process stops every process
    at the same step (`preemption.SyncedStop`)."""
    hook_list = HookList([*hooks, *([OnStep(on_step)] if on_step else []),
                          *loss_curve_hooks(cfg, primary=jax.process_index() == 0)])  # <run_dir>/loss.png
    t: Trainer | None = None
    # One run per run directory (process 0 writes it): a second run is refused before it touches anything.
    lock = lock_run_dir(cfg.run_dir) if jax.process_index() == 0 else None
    stop = stop_source(cfg.checkpoint.on_signal)
    try:
        with stop:
            t = setup(cfg, hook_list)
            t.stop = stop
            return _run(t)
    finally:
        # Also on an exception (divergence, Ctrl-C, a hook's fault): in-flight saves of good steps are committed
        # before the error propagates, and files and threads are released.
        if t is not None:
            _close(t)
        hook_list.close()
        if lock is not None:
            lock.release()


def _run(t: Trainer) -> TrainResult:
    cfg, steps = t.cfg, t.cfg.train.steps
    if t.is_primary:
        print(memory_report(cfg, t.mesh, t.engine.memory_report()) + "\n" + metrics_lib.peak_line(t.peak),
              flush=True)
    t.progress = _progress(t)
    t.hooks.on_phase(Phase.COMPILING, t.start_step)

    if t.start_step == steps and steps > 0 and not t.checkpointer.persisted(steps):
        # Resumed at the end from a copy that never reached the persistent tier (the process was killed while
        # persisting its final checkpoint): persist it now, or a reboot would lose the run's last steps.
        _save(t, steps)
    step, pending = t.start_step, None  # pending: (step, its metrics still on the device, seconds the call took)
    last_done = time.perf_counter()
    stopped = False
    while step < steps or pending is not None:
        if t.stop.should_stop(step):  # asked at every step, by every process of the job
            step, stopped = _stop_with_checkpoint(t, step, pending), True
            break
        dispatched = None
        if step < steps:
            step += 1
            batch = jax.make_array_from_process_local_data(t.engine.batch_sharding, _next_batch(t, step))
            controls = t.monitor.controls(update_norm=t.engine.guards_update_norm)
            called = time.perf_counter()
            metrics = t.engine.step(batch, t.hooks.on_controls(step, controls))
            dispatched = (step, metrics, time.perf_counter() - called)
        if pending is not None:
            last_done, verdict = _finish(t, pending, last_done)
            if verdict.action is not None:
                step = _act(t, pending[0], verdict)  # the step dispatched meanwhile is dropped with it
                pending, last_done = None, _paused(t)
                continue
        pending = dispatched
        # A checkpoint or an evaluation of step s waits for it before step s+1 is dispatched: both need the state
        # of step s (and never one with an anomaly). So does the first step (it compiles): the steps' times start
        # from its end with no step in flight.
        if pending is not None and (_checkpoint_due(cfg, pending[0]) or eval_due(cfg, pending[0])
                                    or pending[0] == t.start_step + 1):
            last_done, verdict = _finish(t, pending, last_done, evaluate=eval_due(cfg, pending[0]))
            pending = None
            if verdict.action is not None:
                step = _act(t, step, verdict)
            elif _checkpoint_due(cfg, step):
                _save(t, step)
            last_done = _paused(t)  # neither the save's blocking part nor an evaluation is a training step
    if t.progress is not None:
        t.progress.close()
    t.hooks.on_phase(Phase.CHECKPOINTING, steps)  # the final checkpoint is committed before train() returns
    t.checkpointer.close()
    t.hooks.on_phase(Phase.TRAINING, steps)
    _report_checkpoint_errors(t)
    _stop_unless_persisting(t)  # the last saves' failures may be the ones that reach the limit
    if stopped:
        raise Preempted(f"stopped by {t.stop.name} after step {step}: {persisted_text(_newest_persisted(t))}",
                        t.stop.signum)
    t.hooks.on_phase(Phase.DONE, steps)
    return TrainResult(t.run_dir, steps, t.history, _final_params(t), newest_persisted=_newest_persisted(t),
                       start_step=t.start_step, rollbacks=tuple(t.rollbacks))


def _stop_with_checkpoint(t: Trainer, step: int, pending: tuple[int, dict, float] | None) -> int:
    """A signal arrived: finish the step in flight (or act on its anomaly) and save a checkpoint of the newest good
    step unless it has one; returns that step."""
    if pending is not None:
        _, verdict = _finish(t, pending, time.perf_counter())
        if verdict.action is not None:
            step = _act(t, pending[0], verdict)
    if step > t.start_step and not _checkpoint_due(t.cfg, step):
        _save(t, step)
    log.warning("%s: stopping after step %d, its checkpoint saved", t.stop.name, step)
    return step


def _final_params(t: Trainer) -> Any:
    """The engine's final parameters, unless gathering them would not fit in memory: a paged engine holds a model
    larger than RAM page by page, never whole, and its parameters are in its checkpoints."""
    m = t.cfg.model
    nbytes = models.get(m).param_count["total"] * np.dtype(m.param_dtype).itemsize
    # (a paged engine keeps to its plan's host budget: `params_room`)
    room = t.engine.params_room() if hasattr(t.engine, "params_room") else gather_room()
    # Process 0's decision on every process: gathering a state sharded across processes is a collective.
    if not from_primary(int(nbytes <= room)):
        log.info("the final parameters (%s B) are not gathered in memory (%s B available); read them from the "
                 "checkpoint", f"{nbytes:,}", f"{2 * room:,}")
        return None
    return t.engine.params()


def _next_batch(t: Trainer, step: int) -> np.ndarray:
    """This process's rows of the next batch that is not in a skipped window; remembers where it came from."""
    while any(a <= t.data.batch_index <= b for a, b in t.skips):
        t.data.skip(1)
    index = t.data.batch_index
    batch = next(t.data)
    t.trail[step] = (index, t.data.state().to_dict())
    return t.hooks.on_batch(step, index, batch)


def _checkpoint_due(cfg: Config, step: int) -> bool:
    every = cfg.checkpoint.every
    return bool(every and step % every == 0) or (step == cfg.train.steps and cfg.checkpoint.at_end)


def _save(t: Trainer, step: int) -> None:
    t.hooks.on_phase(Phase.CHECKPOINTING, step)
    meta = {"data": t.data.state().to_dict(), "engine": t.engine.state_meta(), "data_skips": t.skips,
            "tee": t.monitor.state_dict()}
    # A held snapshot (an engine with immutable state) is copied in the background: no stall. The checkpoint
    # releases it when its copy is done; the engine sees that through the snapshot itself. Unless every process
    # writes its own shards, only process 0 writes checkpoints: the others take no held snapshot (waiting to
    # afford one would stall the whole group).
    snapshot = t.engine.state_snapshot(may_hold=t.is_primary or t.checkpointer.per_process)
    handle = t.checkpointer.save(step, snapshot, meta)
    info = {"stall_s": handle.stall_s if handle else 0.0, "state": handle.state if handle else "not primary",
            "held": handle is not None and snapshot.held}
    t.carry["ckpt/stall_s"] = info["stall_s"]
    t.carry["ckpt/step"] = step
    t.trail = {}
    t.monitor.checkpoint_saved()
    t.hooks.on_checkpoint(step, info)
    t.hooks.on_phase(Phase.TRAINING, step)
    # After the save: its snapshot, the newest state, is in the memory tier when the run stops.
    _stop_unless_persisting(t)


def _act(t: Trainer, bad_step: int, verdict: Verdict) -> int:
    """Carry out a verdict about `bad_step`; returns the step the loop continues after."""
    if verdict.action in (Action.RESTART, Action.EXCLUDE):
        code = EXIT_RESTART if verdict.action == Action.RESTART else EXIT_EXCLUDE
        raise RestartRequested(f"step {bad_step}: {verdict.action.value} requested: {verdict.reason}. Under "
                               "`angel-jax launch` the watchdog restarts from the last checkpoint; otherwise run "
                               "the same command again to resume", code)
    return _rollback(t, bad_step, verdict)


def _rollback(t: Trainer, bad_step: int, verdict: Verdict) -> int:
    """Back to the newest valid checkpoint (or the initial state), with the data moved past the bad window."""
    t.hooks.on_phase(Phase.RESTORING, bad_step)
    t.checkpointer.wait()  # a save still being committed is the newest good state
    restored = t.checkpointer.restore_latest()
    # The detectors go back with the model: their baselines describe the restored state's figures.
    if restored is not None:
        to_step, arrays, meta, tier = restored
        t.engine.load_state(arrays, meta.get("engine", {}))
        if "tee" in meta:
            t.monitor.load_state_dict(meta["tee"])
        else:
            t.monitor.reset()
    else:  # no checkpoint yet: the deterministic initial state
        to_step, tier = 0, "initial state"
        t.engine.close()
        t.engine = build_engine(t.cfg, t.mesh)
        t.monitor.reset()
    first = min((i for s, (i, _) in t.trail.items() if s > to_step), default=t.trail[bad_step][0])
    window = [first, t.trail[bad_step][0]]
    t.data.restore(data_lib.IteratorState.from_dict(t.trail[bad_step][1]))
    t.skips.append(window)
    t.trail = {}
    t.monitor.rolled_back(bad_step, to_step)
    t.rollbacks.append({"step": bad_step, "to_step": to_step})
    log.warning("step %d: %s -> rolled back to step %d (%s), skipping global batches %d..%d",
                bad_step, verdict.reason, to_step, tier, *window)
    if t.is_primary:
        t.events.write("rollback", step=bad_step, to_step=to_step, tier=tier, skipped_batches=window,
                       reason=verdict.reason)
        for sink in t.sinks:
            sink.truncate_after(to_step)
    t.history = [r for r in t.history if r["step"] <= to_step]
    if t.progress is not None:
        t.progress.n = to_step
        t.progress.refresh()
    t.hooks.on_phase(Phase.TRAINING, to_step)
    return to_step


def _report_checkpoint_errors(t: Trainer) -> None:
    """Background save failures (a full disk, ...), once each, in the events log: the checkpoint manager has
    logged each on one line naming its cause. A few do not stop training; `_stop_unless_persisting` decides."""
    for error in t.checkpointer.poll_errors():
        if t.is_primary or t.checkpointer.per_process:  # (every process saves its own shards: its own failures)
            t.events.write("checkpoint_failed", step=error.step, stage=error.stage, message=str(error))


def _stop_unless_persisting(t: Trainer) -> None:
    """Raise PersistenceFailed once checkpoint.max_persist_failures persists in a row have failed. Every process
    decides alike (at the same checkpoints): process 0's streak, or, when every process saves its own shards, any
    process's."""
    streak = t.checkpointer.engine.persist_streak
    if t.checkpointer.per_process:
        stop = from_any(streak.exhausted)
    else:
        stop = bool(from_primary(int(streak.exhausted)))
    if not stop:
        return
    t.checkpointer.wait()  # the newest save's snapshot is committed before the message lists the memory tier
    _report_checkpoint_errors(t)
    if t.is_primary:
        t.events.write("checkpoint_persistence_failed", failures=streak.failures, step=streak.last_step,
                       cause=streak.last_cause, newest_persisted=_newest_persisted(t))
    # One line, printed by the command line (`error: ...`) or the worker; not logged here as well.
    raise PersistenceFailed(_not_persisting(t, streak), step=streak.last_step, stage="persist")


def _not_persisting(t: Trainer, streak: PersistStreak) -> str:
    """PersistenceFailed's message: one line, with the cause, the newest persisted step and what to do."""
    options = t.checkpointer.options
    if streak.exhausted:
        what = (f"{streak.count_text()} (checkpoint.max_persist_failures={streak.limit}), the last at step "
                f"{streak.last_step}: {streak.last_cause}")
    else:
        what = "another process's persists failed (see its error)"
    snapshots = _committed_steps(t, "memory")
    kept = (f"the memory-tier snapshots of steps {', '.join(map(str, snapshots))} are kept in "
            f"{options.resolved_memory_dir()}" if snapshots else "the memory tier holds no snapshot")
    persisted = persisted_text(_newest_persisted(t))
    return (f"checkpoints are not reaching the persistent tier {options.persistent_dir}: {what}. "
            f"{persisted[0].upper()}{persisted[1:]}; {kept}. Fix the persistent directory, then run the same "
            "command again to resume from the newest snapshot (checkpoint.max_persist_failures=0 never stops)")


def _newest_persisted(t: Trainer) -> int | None:
    """The newest step committed in the persistent tier (this process's, as it lists it), or None."""
    return max(_committed_steps(t, "persistent"), default=None)


def _committed_steps(t: Trainer, tier: str) -> list[int]:
    """The steps committed in one of this process's tiers, oldest first."""
    return [info.step for info in t.checkpointer.engine.list()
            if tier in info.tiers and info.tiers[tier].state != "partial"]


def _finish(t: Trainer, pending: tuple[int, dict, float], last_done: float,
            evaluate: bool = False) -> tuple[float, Verdict]:
    """Wait for a dispatched step, judge it, (with `evaluate`, and no step dispatched after it) evaluate the
    validation loss, log it. Returns the time the step completed (before any evaluation) and the verdict."""
    step, device_metrics, call_s = pending
    waiting = time.perf_counter()
    values = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
    done = time.perf_counter()
    # Between completions; at least the call itself, for an engine whose step returns once it has computed (the
    # sharded paged engine on the CPU backend): its completion was before the previous step was judged.
    interval = max(done - last_done, call_s)
    if step == t.start_step + 1:
        values["perf/first_step_time"] = interval  # includes compilation
        t.hooks.on_phase(Phase.TRAINING, step)
        phase = Phase.COMPILING
    else:
        tokens = t.cfg.train.batch_size * t.cfg.model.seq_len
        # Over the recent steps, not this interval alone: see metrics.StepWindow.
        step_time = t.window.add(interval)
        values.update(metrics_lib.throughput(step_time, tokens, t.flops_per_token, t.peak, jax.device_count()))
        values["perf/mfu_is_estimate"] = float(t.peak.is_estimate)
        # This process's time outside waiting for the device: in a synchronous data-parallel step every rank's
        # step time is the same, but a rank slowed on its host (data, hooks, a busy CPU) shows here.
        values["perf/busy_time"] = max(0.0, interval - (done - waiting))
        phase = Phase.TRAINING
    verdict = t.monitor.observe(step, values, phase=phase)
    values.update(verdict.metrics)
    for event in verdict.events:
        t.hooks.on_anomaly(event)
    _report_checkpoint_errors(t)
    if verdict.action is not None:  # this step's state is abandoned: not logged as a training step
        return done, verdict
    cfg = t.cfg
    if evaluate:
        values.update(_evaluate(t, step))
        t.last_eval_loss = values["eval/loss"]
    t.hooks.on_step(step, values)
    if t.is_primary and (step % cfg.train.log_every == 0 or step == t.start_step + 1 or step == cfg.train.steps
                         or verdict.events or evaluate):
        values.update(t.carry)
        t.carry.clear()
        record = {k: round(v, 6) if isinstance(v, float) else v for k, v in values.items()}
        t.history.append({"step": step, **record})
        for sink in t.sinks:
            sink.write(step, record)
    if t.progress is not None:
        postfix = {"loss": f"{values['loss']:.3f}"}
        if "perf/tokens_per_s" in values:
            postfix["tok/s"] = f"{values['perf/tokens_per_s']:.0f}"
            postfix["mfu"] = f"{values['perf/mfu']:.1%}" + ("~" if t.peak.is_estimate else "")
        if t.last_eval_loss is not None:
            postfix["eval"] = f"{t.last_eval_loss:.3f}"
        t.progress.set_postfix(postfix, refresh=False)
        t.progress.update(1)
    return done, verdict


def _paused(t: Trainer) -> float:
    """A pause ended (a compilation, a checkpoint, an evaluation, a rollback), no step in flight: the steps' times
    start again from now."""
    t.window.restart()
    return time.perf_counter()


def _evaluate(t: Trainer, step: int) -> dict[str, float]:
    assert t.validation is not None, "evaluation asked for without validation batches"
    # A phase without step progress for the watchdog: the first evaluation compiles, which on a large model
    # takes longer than the hang timeout of a training step.
    t.hooks.on_phase(Phase.EVALUATING, step)
    values = evaluate(t.engine, t.validation, tokenizer=t.cfg.data.tokenizer)
    t.hooks.on_phase(Phase.TRAINING, step)
    return values


def _close(t: Trainer) -> None:
    for closer in (t.checkpointer.close, *(s.close for s in t.sinks), t.engine.close, t.events.close):
        try:
            closer()
        except Exception as e:  # noqa: BLE001 - closing must not mask the error that got us here
            log.warning("while closing the run: %s", e)


def _progress(t: Trainer) -> Any:
    if not (t.is_primary and t.cfg.train.progress):
        return None
    # A bar on a terminal; in a log file plain lines, every train.log_every steps and at least every 30 s.
    return progress_display(t.cfg.name, t.cfg.train.steps, t.start_step, every=t.cfg.train.log_every)
