"""Validation loss (angel_jax/train/evaluation.py): the engines' `eval_loss` against each other and against the
step's own loss, the paged engine's evaluation leaving its pages, accounting, lock-free state and timelines as they
were, and the training loop's evaluations: logged, identical with and without a resume, and changing no training
step. Runs that train through the loop are `slow`."""

from __future__ import annotations

import math
import struct
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from angel_jax.data import shards as data_lib
from angel_jax.config import (Config, ConfigError, DataConfig, MemoryConfig, ModelConfig, OptimizerConfig,
                              TrainConfig, load_config)
from angel_jax.phases import Phase
from angel_jax.schedule import execute
from angel_jax.train import metrics as M
from angel_jax.train.engines import InMemoryEngine
from angel_jax.train.hooks import TrainHooks
from angel_jax.train.evaluation import ValidationSet, eval_due, eval_metrics
from angel_jax.train.loop import data_dir_for, train
from angel_jax.train.paged import RECORDED_STEPS, WARMUP_STEPS, PagedTrainEngine
from angel_jax.train.step import make_loss_fn
import models
from test_paged import batches

MODEL = ModelConfig(d_model=32, n_layers=2, n_heads=2, seq_len=32, compute_dtype="float32")
BATCH = 4
PAGE = 16384  # 3-4 pages per stage
EXACT_KEYS = ("loss", "grad_norm", "update_norm", "lr")


def _mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((1,), ("data",), devices=jax.devices()[:1], axis_types=(jax.sharding.AxisType.Auto,))


def _engine_cfg(tmp_path: Path, **memory) -> Config:
    # conftest's tiny model and optimizer, the paged loop test's page size: the programs other tests compile too.
    return Config(name="eval", model=MODEL, optimizer=OptimizerConfig(lr=3e-3, warmup_steps=2, schedule="constant"),
                  train=TrainConfig(steps=30, batch_size=BATCH, run_dir=str(tmp_path / "run")),
                  memory=MemoryConfig(**memory))


def _on(engine, rows: jax.Array) -> jax.Array:
    return jax.device_put(rows, engine.batch_sharding)


# --------------------------------------------------------------------------------------------- engines


@pytest.mark.compares_programs
def test_paged_evaluation_streams_from_disk_and_matches_the_in_memory_engine(tmp_path):
    """Every page family of every stage on disk (the paged engine's hardest placement): before each step, both
    engines' eval_loss equals the loss that step then reports for the same batch, the two engines agree, and the
    evaluation leaves the page store as it found it (every page's tiers, every tier's bytes)."""
    (tmp_path / "disk").mkdir()
    reference = InMemoryEngine(_engine_cfg(tmp_path), _mesh())
    paged = PagedTrainEngine(_engine_cfg(tmp_path, mode="paged", page_size=PAGE, device_budget=700_000,
                                         host_budget=650_000, disk_dir=str(tmp_path / "disk")), _mesh())
    try:
        plan, store = paged.built.plan, paged.built.store
        assert set(plan.home) == set(plan.opt_home) == set(plan.grad_home) == {"disk"}, plan
        pages = store.page_ids()
        for rows in batches(3, MODEL, BATCH):
            paged.built.updater.drain()
            store.wait_all()
            before = store.bytes_used(), {p: store.where(p) for p in pages}
            evals = float(reference.eval_loss(_on(reference, rows))), float(paged.eval_loss(_on(paged, rows)))
            store.wait_all()
            assert (store.bytes_used(), {p: store.where(p) for p in pages}) == before
            assert before[0]["device"] == 0, "nothing of a disk-homed model stays on the device"
            losses = float(reference.step(_on(reference, rows))["loss"]), float(paged.step(_on(paged, rows))["loss"])
            np.testing.assert_allclose(evals, losses, rtol=1e-6)  # the loss before the step's update
            np.testing.assert_allclose(evals[1], evals[0], rtol=1e-6)
        assert losses[0] < float(np.log(256)) - 0.3, "the steps must have changed the parameters evaluated"
    finally:
        reference.close()
        paged.close()


@pytest.mark.compares_programs
def test_lock_free_evaluation_waits_for_pending_updates_and_restarts_a_recording(tmp_path, monkeypatch):
    """staleness 1 with host-homed streamed stages: an evaluation right after a step sees every update of that
    step (the loss of the parameters `params()` returns once all updates landed), counts no stale use, and a
    timeline recording it interrupts starts over after it instead of measuring it as part of a step."""
    recorders: list[tuple[float, execute.Recorder]] = []

    class Spy(execute.Recorder):
        def __init__(self) -> None:
            super().__init__()
            recorders.append((time.perf_counter(), self))

    monkeypatch.setattr(execute, "Recorder", Spy)
    engine = PagedTrainEngine(_engine_cfg(tmp_path, mode="paged", page_size=PAGE, device_budget=900_000,
                                          host_budget=1_200_000, staleness=1, lock_free_from=0), _mesh())
    data = batches(WARMUP_STEPS + RECORDED_STEPS + 2, MODEL, BATCH)
    graphdef, _ = models.get(MODEL).abstract()
    whole_loss = jax.jit(make_loss_fn(graphdef, models.get(MODEL).loss))
    try:
        assert "host" in engine.built.plan.home and engine.built.plan.streamed
        for rows in data[:WARMUP_STEPS + 1]:  # the last of these is the first recorded step
            engine.step(_on(engine, rows))
        assert len(recorders) == 1
        counters = engine.built.updater.stale_uses, engine.built.updater.max_lag
        eval_started = time.perf_counter()
        evaluated = float(engine.eval_loss(_on(engine, data[0])))
        assert (engine.built.updater.stale_uses, engine.built.updater.max_lag) == counters
        params = jax.tree.map(jnp.asarray, engine.params())
        np.testing.assert_allclose(evaluated, float(whole_loss(params, jnp.asarray(data[0]))), rtol=1e-6)
        for rows in data[WARMUP_STEPS + 1:]:
            engine.step(_on(engine, rows))
    finally:
        engine.close()  # completes the recording
    # The recording of steps 4 and 5 was dropped at the evaluation; a new one recorded the two steps after it.
    assert len(recorders) == 2 and recorders[1][0] > eval_started, recorders
    timeline = engine.executor.last_timeline
    assert timeline is not None and sum(e.label == "forward embed" for e in timeline.events) == RECORDED_STEPS
    assert (tmp_path / "run" / "timeline_measured.json").is_file()


# --------------------------------------------------------------------------------------------- data


@pytest.fixture(scope="module")
def val_corpus(tmp_path_factory, toy_corpus) -> tuple[Path, Path]:
    """(the toy source, a data directory of it with 10% held out): ~860 validation tokens, 6 batches of 4 x 33.
    Not the session's toy directory, which other tests read without a validation split."""
    source, _ = toy_corpus
    data_dir = tmp_path_factory.mktemp("toy-val") / "toy-byte-val0.1"
    data_lib.ensure_prepared(data_dir, str(source), tokenizer="byte", val_fraction=0.1)
    return source, data_dir


def _cfg_for(val_corpus, **train) -> Config:
    source, data_dir = val_corpus
    return Config(model=MODEL, data=DataConfig(source=str(source), dir=str(data_dir), val_fraction=0.1),
                  train=TrainConfig(batch_size=BATCH, eval_every=4, **train))


def test_validation_batches_are_fixed_held_out_windows_shared_out_like_training_rows(val_corpus):
    cfg = _cfg_for(val_corpus, eval_batches=3)
    whole = ValidationSet.load(cfg, val_corpus[1])
    assert len(whole.batches) == 3 and all(b.shape == (BATCH, MODEL.seq_len + 1) for b in whole.batches)
    again = ValidationSet.load(cfg, val_corpus[1])
    assert all(np.array_equal(a, b) for a, b in zip(whole.batches, again.batches))
    halves = [ValidationSet.load(cfg, val_corpus[1], shard_index=i, shard_count=2) for i in range(2)]
    for k, rows in enumerate(whole.batches):
        np.testing.assert_array_equal(np.concatenate([h.batches[k] for h in halves]), rows)
    # Windows of the held-out tail of the token stream.
    meta = data_lib.load_meta(val_corpus[1])
    val = np.concatenate([np.fromfile(val_corpus[1] / s["file"], data_lib.DTYPE) for s in meta["val_shards"]])
    windows = {tuple(val[w * 33:(w + 1) * 33].tolist()) for w in range(len(val) // 33)}
    assert all(tuple(row.tolist()) in windows for b in whole.batches for row in b)
    assert meta["train_tokens"] + len(val) == meta["total_tokens"]


def test_eval_steps_and_metrics():
    cfg = Config(train=TrainConfig(steps=10, eval_every=4))
    assert [s for s in range(1, 11) if eval_due(cfg, s)] == [4, 8, 10]
    assert not any(eval_due(Config(train=TrainConfig(steps=10)), s) for s in range(1, 11))
    m = eval_metrics(2.0, "byte")
    assert m == {"eval/loss": 2.0, "eval/ppl": math.exp(2.0), "eval/bpb": 2.0 / math.log(2)}
    assert set(eval_metrics(2.0, "bpe")) == {"eval/loss", "eval/ppl"}
    assert eval_metrics(1e4, "bpe")["eval/ppl"] == math.inf


def test_a_validation_split_gets_its_own_data_directory():
    plain, held_out = Config(), Config(data=DataConfig(val_fraction=0.01))
    assert data_dir_for(plain) == Path("data/stdlib-byte")
    assert data_dir_for(held_out) == Path("data/stdlib-byte-val0.01")


# --------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize("overrides, key", [
    (["train.eval_every=-1"], "train.eval_every"),
    (["train.eval_batches=-2"], "train.eval_batches"),
    (["train.eval_every=10", "train.eval_batches=0"], "train.eval_batches"),
    (["data.val_fraction=1.0"], "data.val_fraction"),
    (["data.val_fraction=-0.1"], "data.val_fraction"),
])
def test_bad_evaluation_settings_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert repr(key) in str(e.value)


def test_evaluation_without_a_validation_split_names_data_val_fraction(tmp_path, write_tiny_config):
    """The session's toy directory has no validation split: refused at set-up, before any model is built."""
    cfg = load_config(write_tiny_config(tmp_path, train={"eval_every": 5}))
    with pytest.raises(ConfigError, match=r"'train.eval_every'=5 .* no validation split: set 'data.val_fraction'"):
        train(cfg)


def test_more_evaluation_batches_than_the_split_holds_names_both_keys(tmp_path, write_tiny_config, val_corpus):
    cfg = load_config(write_tiny_config(tmp_path, data={"dir": str(val_corpus[1]), "val_fraction": 0.1},
                                        train={"eval_every": 5, "eval_batches": 7}))
    with pytest.raises(ConfigError, match=r"'train.eval_batches'=7 .* \(6 batches\): raise 'data.val_fraction'"):
        train(cfg)


# --------------------------------------------------------------------------------------------- the loop

STEPS, EVERY = 12, 4
SLOW_EVAL_S = 0.5  # per validation batch, in the reference run: an evaluation far longer than a step


def _write(write_tiny_config, val_corpus, directory: Path, run: str, eval_every: int = EVERY) -> Path:
    return write_tiny_config(directory, run, data={"dir": str(val_corpus[1]), "val_fraction": 0.1},
                             train={"steps": STEPS, "eval_every": eval_every, "eval_batches": 2},
                             logging={"tensorboard": True})


class _Phases(TrainHooks):
    def __init__(self) -> None:
        self.seen: list[tuple[Phase, int]] = []

    def on_phase(self, phase: Phase, step: int) -> None:
        self.seen.append((phase, step))


def _train(cfg_path: Path, overrides: list[str] = (), phases: _Phases | None = None) -> dict[int, dict[str, float]]:
    exact: dict[int, dict[str, float]] = {}
    train(load_config(cfg_path, list(overrides)), hooks=[phases] if phases else [],
          on_step=lambda step, values: exact.__setitem__(step, values))
    return exact


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory, write_tiny_config, val_corpus
              ) -> tuple[Path, dict[int, dict[str, float]], list[tuple[Phase, int]]]:
    """12 steps evaluated every 4, each validation batch made slow (the loop must keep that out of step times)."""
    directory = tmp_path_factory.mktemp("evaluated")
    original = InMemoryEngine.eval_loss

    def slow(self, batch):
        time.sleep(SLOW_EVAL_S)
        return original(self, batch)

    phases = _Phases()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(InMemoryEngine, "eval_loss", slow)
        exact = _train(_write(write_tiny_config, val_corpus, directory, "evaluated"), phases=phases)
    return directory / "evaluated", exact, phases.seen


def _tensorboard_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> step -> value from the event files (TFRecord framing around Event protos)."""
    from tensorboardX.proto import event_pb2

    out: dict[str, dict[int, float]] = {}
    for path in sorted(log_dir.glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack_from("<Q", data, pos)
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for v in event.summary.value:
                out.setdefault(v.tag, {})[event.step] = v.simple_value
    return out


@pytest.mark.slow
def test_evaluations_are_logged_and_change_no_training_step(evaluated, tmp_path, write_tiny_config, val_corpus):
    run_dir, exact, phases = evaluated
    plain = _train(_write(write_tiny_config, val_corpus, tmp_path, "plain", eval_every=0))
    assert sorted(plain) == sorted(exact) == list(range(1, STEPS + 1))
    for step in exact:
        assert [exact[step][k] for k in EXACT_KEYS] == [plain[step][k] for k in EXACT_KEYS], step
    assert not any(k.startswith("eval/") for values in plain.values() for k in values)

    records = {r["step"]: r for r in M.read_jsonl(run_dir / "metrics.jsonl")}
    evals = [s for s, r in records.items() if "eval/loss" in r]
    assert evals == [4, 8, 12]
    for s in evals:
        r = records[s]
        assert r["eval/loss"] == round(exact[s]["eval/loss"], 6)
        assert r["eval/ppl"] == pytest.approx(math.exp(exact[s]["eval/loss"]), rel=1e-5)
        assert r["eval/bpb"] == pytest.approx(exact[s]["eval/loss"] / math.log(2), rel=1e-5)
        assert r["perf/eval_s"] >= 2 * SLOW_EVAL_S
    assert records[12]["eval/loss"] < records[4]["eval/loss"] < math.log(256), "held-out loss falls"
    # The evaluation's time is its own: the step after it is timed from the evaluation's end.
    for s in (5, 9):
        assert records[s]["perf/step_time"] < SLOW_EVAL_S, records[s]
    # The watchdog sees an evaluation as a phase without steps (its first compiles), then training again.
    assert [s for p, s in phases if p == Phase.EVALUATING] == evals
    assert all(phases[phases.index((Phase.EVALUATING, s)) + 1] == (Phase.TRAINING, s) for s in evals)
    tb = _tensorboard_scalars(run_dir / "tb")
    assert sorted(tb["eval/loss"]) == evals
    assert [tb["eval/loss"][s] for s in evals] == pytest.approx([exact[s]["eval/loss"] for s in evals], rel=1e-6)


@pytest.mark.slow
def test_evaluations_after_a_resume_equal_the_uninterrupted_runs(evaluated, tmp_path, write_tiny_config, val_corpus):
    """6 steps (evaluated at 4 and at its last step, 6), then the same run directory resumed to 12: the evaluations
    of steps 4, 8 and 12 are the uninterrupted run's, bit for bit."""
    _, straight, _ = evaluated
    cfg_path = _write(write_tiny_config, val_corpus, tmp_path, "resumed")
    first = _train(cfg_path, [f"train.steps={STEPS // 2}"])
    second = _train(cfg_path)
    assert sorted(second) == list(range(STEPS // 2 + 1, STEPS + 1))
    resumed = {**first, **second}
    assert [s for s in sorted(resumed) if "eval/loss" in resumed[s]] == [4, 6, 8, 12]
    for s in (4, 8, 12):
        assert resumed[s]["eval/loss"] == straight[s]["eval/loss"], s
    records = M.read_jsonl(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in records if "eval/loss" in r] == [4, 6, 8, 12]
