"""Gradient accumulation (`train.micro_batch_size`): a step over M micro-batches gives the whole batch's loss and
gradient in both engines; the paged engine runs them layer-major (a streamed stage is fetched once per access and
runs every micro-batch), so its page traffic per step does not grow with M; the planner charges M calls of the
micro-batch's time per access; bad sizes are refused by key."""

from __future__ import annotations

import copy
import dataclasses
import functools
import gc
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from angel_jax.config import Config, ConfigError, MemoryConfig, ModelConfig, OptimizerConfig, TrainConfig, \
    config_from_dict
import angel_jax.schedule.budgets as budgets_lib
import angel_jax.schedule.runtime as runtime_lib
from angel_jax.schedule.costs import profile_costs
from angel_jax.schedule.blueprint import blueprint
from angel_jax.schedule.budgets import fixed_device_bytes
from angel_jax.schedule.runtime import build_paged_runtime
from angel_jax.schedule.simulate import StageCost, Bandwidths, simulate
from angel_jax.schedule.trace import split_batch
from angel_jax.optim import make_optimizer
from angel_jax.train.engines import InMemoryEngine
from angel_jax.train.step import make_loss_fn, make_train_step
from angel_jax.cli.plan import report
import models
from test_paged import batches

# Narrow and deep enough that a small device budget streams most stages (as in test_paged.py). SGD with clipping:
# a gradient off by a factor (a missing 1/M) or a norm taken per micro-batch changes the trajectory; Adam would
# normalise a scale away.
MODEL = ModelConfig(d_model=64, n_layers=6, n_heads=2, seq_len=16, compute_dtype="float32")
PAGE = 49 * 4096  # one page per block
BATCH, MICRO, STEPS = 8, 2, 4
STREAMING_BUDGET = 1_900_000  # bytes: activations, a window of streamed stages, two or three resident stages


def _cfg(micro: int = 0, mode: str = "in_memory", budget: int = 0) -> Config:
    return Config(model=MODEL, optimizer=OptimizerConfig(name="sgd", lr=0.3, warmup_steps=1, grad_clip=0.5),
                  train=TrainConfig(steps=STEPS, batch_size=BATCH, micro_batch_size=micro),
                  memory=MemoryConfig(mode=mode, page_size=PAGE, device_budget=budget))


def _data() -> list[jax.Array]:
    return batches(STEPS, MODEL, BATCH)


def _mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


@functools.lru_cache(maxsize=1)
def _in_memory() -> tuple[list[dict], float, object]:
    """The in-memory engine with micro-batches: metrics of every step, an evaluation's loss, the initial state."""
    engine = InMemoryEngine(_cfg(MICRO), _mesh())
    initial = jax.tree.map(jnp.array, engine.state)  # a copy: the engine donates its state
    try:
        metrics = [{k: float(v) for k, v in engine.step(b).items()} for b in _data()]
        return metrics, float(engine.eval_loss(_data()[0])), initial
    finally:
        engine.close()


def _reference(state) -> tuple[list[dict], float]:
    """The reference step (train/step.py, one jitted function) on the whole batch in one go, from `state`."""
    cfg = _cfg()
    staged = models.get(cfg.model)
    graphdef, _ = staged.abstract()
    tx, schedule = make_optimizer(cfg.optimizer, cfg.train.steps)
    step = jax.jit(make_train_step(graphdef, tx, schedule, staged.loss))
    metrics = []
    for b in _data():
        state, m = step(state, b)
        metrics.append({k: float(v) for k, v in m.items()})
    return metrics, float(jax.jit(make_loss_fn(graphdef, staged.loss))(state.params, _data()[0]))


class _Counting:
    """The executor's stage functions, counting calls per (op, kind) (the scanning ones per (op, kind, micro-batches));
    the shared compiled ones stay untouched."""

    def __init__(self, fns):
        self.calls: Counter = Counter()
        wrapped = copy.copy(fns)
        wrapped.forward = {k: self._count("forward", k, f) for k, f in fns.forward.items()}
        wrapped.backward = {k: self._count("backward", k, f) for k, f in fns.backward.items()}
        wrapped.forward_micro = {k: self._count("forward_micro", k, f) for k, f in fns.forward_micro.items()}
        wrapped.backward_micro = {k: self._count("backward_micro", k, f) for k, f in fns.backward_micro.items()}
        self.fns = wrapped

    def _count(self, op, kind, fn):
        def call(*args):  # a scanning call: counted with the micro-batches it scans
            self.calls[(op, kind, args[1].shape[0]) if op.endswith("_micro") else (op, kind)] += 1
            return fn(*args)
        return call


def _paged(micro: int, monkeypatch) -> tuple[list[dict], float, object, Counter, Counter, list]:
    """Metrics, an evaluation's loss, the engine, stage calls and parameter-page fetches of the last step, and the
    batch shapes profiling timed."""
    profiled = []

    def profile(fns, updates, pl, ol, small, tokens, where, micro_batches=1):
        profiled.append((tuple(tokens.shape), micro_batches))
        return profile_costs(fns, updates, pl, ol, small, tokens, where, micro_batches)

    monkeypatch.setattr(runtime_lib, "profile_costs", profile)
    cfg = _cfg(micro, "paged", STREAMING_BUDGET)
    params = jax.tree.map(np.array, _in_memory()[2].params)  # the in-memory engine's initial parameters
    data = _data()
    engine = build_paged_runtime(cfg, params, data[0])
    counting = _Counting(engine.executor.fns)
    engine.executor.fns = counting.fns
    fetches: Counter = Counter()
    prefetch = engine.store.prefetch
    params_pages = engine.model.params_layout.num_pages

    def counted_prefetch(pid, to="device", keep_source=False):
        if to == "device" and pid < params_pages:
            fetches[pid] += 1
        return prefetch(pid, to, keep_source)

    engine.store.prefetch = counted_prefetch
    peak = [0]

    def sample(op, stage):
        jax.effects_barrier()
        peak[0] = max(peak[0], _device_bytes() - baseline)

    gc.collect()
    baseline = _device_bytes()
    engine.executor.on_access = sample
    try:
        metrics = []
        for n, b in enumerate(data):
            if n == len(data) - 1:  # the last step, every function compiled: its calls and fetches alone
                counting.calls.clear()
                fetches.clear()
            metrics.append(engine.executor.step(b))
        calls, step_fetches = Counter(counting.calls), Counter(fetches)
        metrics = [{k: float(v.result() if hasattr(v, "result") else v) for k, v in m.items()} for m in metrics]
        loss = float(engine.executor.eval_loss(data[0]))
    finally:
        engine.close()
    engine.peak_device_bytes = peak[0]
    return metrics, loss, engine, calls, step_fetches, profiled


def _device_bytes() -> int:
    return sum(a.nbytes for a in jax.live_arrays() if a.sharding.memory_kind == "device" and not a.is_deleted())


def _column(metrics: list[dict], key: str) -> list[float]:
    return [m[key] for m in metrics]


def test_split_batch_keeps_each_micro_batch_on_the_ranks_of_its_rows():
    batch = jnp.arange(8 * 3).reshape(8, 3)
    micro = split_batch(batch, 4)
    assert micro.shape == (4, 2, 3)
    np.testing.assert_array_equal(micro[1], batch[1::4])  # rows 1 and 5: one in each half (rank) of the batch
    with pytest.raises(ValueError):
        split_batch(batch, 3)


@pytest.mark.compares_programs
def test_in_memory_micro_batches_give_the_whole_batch_step():
    micro, micro_eval, initial = _in_memory()
    whole, whole_eval = _reference(initial)
    assert whole[-1]["loss"] < whole[0]["loss"] - 0.2, "the toy stream must be learnable"
    for key in ("loss", "grad_norm", "update_norm"):  # the same sums, in another order
        np.testing.assert_allclose(_column(micro, key), _column(whole, key), rtol=1e-5, err_msg=key)
    np.testing.assert_allclose(micro_eval, whole_eval, rtol=1e-5)


@pytest.mark.compares_programs
def test_paged_micro_batches_stream_layer_major_and_match_both_references(monkeypatch):
    ref, ref_eval, _ = _in_memory()
    whole, whole_eval, e1, calls1, fetches1, profiled1 = _paged(0, monkeypatch)
    micro, micro_eval, e4, calls4, fetches4, profiled4 = _paged(MICRO, monkeypatch)
    m = BATCH // MICRO
    assert e4.plan.micro_batches == m and e1.plan.micro_batches == 1
    assert len(e4.plan.streamed) >= len(e4.plan.home) - 3, "most stages must stream"
    # == the in-memory engine with the same micro-batches (per-stage programs against the whole-model program)
    for key in ("loss", "grad_norm", "update_norm"):
        np.testing.assert_allclose(_column(micro, key), _column(ref, key), rtol=1e-5, err_msg=key)
    np.testing.assert_allclose(micro_eval, ref_eval, rtol=1e-5)
    # == the paged engine with the whole batch in one go (the same arithmetic summed in another order)
    for key in ("loss", "grad_norm", "update_norm"):
        np.testing.assert_allclose(_column(micro, key), _column(whole, key), rtol=1e-5, err_msg=key)
    np.testing.assert_allclose(micro_eval, whole_eval, rtol=1e-5)
    # Layer-major: a streamed stage's parameter pages are fetched once per access (forward and backward; the head
    # once), as with one micro-batch; an access is one call whatever M, scanning its M micro-batches.
    for e, fetches in ((e1, fetches1), (e4, fetches4)):
        head = len(e.plan.home) - 1
        assert fetches == {p: 1 if i == head else 2 for i in e.plan.streamed for p in e.model.param_ids(i)}
    assert calls1 and calls4 == Counter({(op + "_micro", kind, m): n for (op, kind), n in calls1.items()})
    # What is live on the device between accesses (streamed pages in flight, saved inputs, gradient sums) fits.
    for e in (e1, e4):
        assert 2 * max(c.param_bytes for c in e.costs) < e.peak_device_bytes <= STREAMING_BUDGET
    # Profiling timed the calls the executor makes: micro-batches of their shape, M scanned per call.
    assert profiled1 == [((BATCH, MODEL.seq_len + 1), 1)] and profiled4 == [((MICRO, MODEL.seq_len + 1), m)]


@pytest.mark.compares_programs
def test_scanned_stage_calls_match_the_calls_one_micro_batch_at_a_time():
    # What the executor runs per access with M micro-batches (one call scanning them) against calling the stage on
    # each micro-batch in turn and summing the gradient pages in float32: the same outputs, gradients, sums of
    # squares and losses, to float rounding (the same operations in the same order; XLA may compile the scanned
    # body's kernels differently).
    bp = blueprint(_cfg(MICRO, "paged", STREAMING_BUDGET))
    fns, stages, m = bp.fns, bp.staged.stages, BATCH // MICRO
    rng = np.random.default_rng(0)

    def random(shape, dtype=np.float32):
        return jnp.asarray((rng.standard_normal(shape) * 0.1).astype(dtype))

    def equal(a, b):
        assert jax.tree.structure(a) == jax.tree.structure(b)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)

    micro = split_batch(_data()[0], m)
    xs, targets = micro[:, :, :-1], micro[:, :, 1:]
    seen = set()
    for i, stage in enumerate(stages):
        layout = bp.params_layout.stage(stage.name)
        dtypes = tuple(p.dtype for p in layout.pages)
        pages = layout.bits(random(p.length, p.dtype) for p in layout.pages)
        head = i == len(stages) - 1
        if not head:
            ys = fns.forward_micro[stage.kind](pages, xs)
        if stage.kind not in seen:
            seen.add(stage.kind)
            dys = targets if head else random(ys.shape)
            scanned = fns.backward_micro[stage.kind](pages, xs, dys)
            acc, dxs, losses = None, [], []
            for k in range(m):
                out = fns.backward[stage.kind](pages, xs[k], dys[k])
                acc = fns.accumulate(acc, out[0], dtypes)
                dxs.append(out[1])
                losses += list(out[3:])
            dpages, sq = fns.mean_grads(acc, m, dtypes)
            # (gradient pages are held as bits: compared as their values)
            equal((layout.values(scanned[0]), *scanned[1:3]),
                  (layout.values(dpages), None if dxs[0] is None else jnp.stack(dxs), sq))
            if head:
                equal(scanned[3], functools.reduce(lambda a, b: a + b, losses))
            else:
                equal(ys, jnp.stack([fns.forward[stage.kind](pages, x) for x in xs]))
        if not head:
            xs = ys
    assert seen == set(bp.staged.kinds())


def test_plan_charges_each_access_the_calls_of_every_micro_batch():
    costs = [StageCost(f"s{i}", 1000, 2000, 0.01, 0.03, 0.001, 0.002) for i in range(4)]
    home = ("device",) * 4
    one = simulate(costs, Bandwidths(), home, home, 1)
    four = simulate(costs, Bandwidths(), home, home, 1, micro_batches=4)
    compute = lambda tl: sum(e.end - e.start for e in tl.events if e.stream == "compute"  # noqa: E731
                             and not e.label.startswith("update"))
    np.testing.assert_allclose(compute(four), 4 * compute(one))
    # Device bytes: the saved stage inputs of the whole batch, the working set of one micro-batch, float32 sums.
    sizes = blueprint(_cfg(0)).sizes
    whole, micro = fixed_device_bytes(_cfg(0), BATCH, sizes), fixed_device_bytes(_cfg(MICRO), BATCH, sizes)
    assert micro < whole
    tokens = BATCH * MODEL.seq_len
    saved = (MODEL.n_layers + 1) * tokens * MODEL.d_model * 4
    assert micro > saved + PAGE  # at least the saved inputs and a block's float32 gradient sums


def test_plan_report_prints_the_micro_batches(monkeypatch):
    cfg = _cfg(MICRO, "paged", STREAMING_BUDGET)
    bp = blueprint(cfg)
    from angel_jax.cli.plan import _estimated_plan, _parser
    args = _parser().parse_args(["unused.yaml", "--estimate", "--peak-tflops", "100"])
    cfg, plan, costs, budgets, bw, source = _estimated_plan(cfg, bp, args)
    assert plan.micro_batches == BATCH // MICRO
    text = "\n".join(report(cfg, plan, costs, budgets, bw, source))
    assert "4 micro-batches of 2 (train.micro_batch_size=2)" in text
    assert plan.summary()["micro_batches"] == 4


def test_estimated_plans_choose_the_micro_batch_size_and_state_mfu_and_bound():
    """With train.micro_batch_size 0 the estimate tries the batch and its halvings; a device budget that holds
    no pass of the whole batch's working set gets a smaller micro-batch. The report states the predicted MFU
    (the training loop's formula over the predicted step) and the busiest stream."""
    from angel_jax.cli.plan import _estimated_plan, _parser, predicted_mfu, step_lines

    args = _parser().parse_args(["unused.yaml", "--estimate", "--peak-tflops", "100", "--h2d-gbps", "5"])
    roomy = _cfg(0, "paged", 10**9)
    cfg, plan, costs, budgets, bw, source = _estimated_plan(roomy, blueprint(roomy), args)
    assert cfg.train.micro_batch_size == BATCH and plan.micro_batches == 1 and "chosen by the planner" in source
    assert bw.h2d == bw.d2h == 5e9 and "h2d, d2h: 5 GB/s (--h2d-gbps)" in bw.source
    whole = budgets_lib.fixed_device_bytes(dataclasses.replace(roomy, train=dataclasses.replace(roomy.train,
                                                                                              micro_batch_size=8)), 8,
                                           blueprint(roomy).sizes)
    tight = _cfg(0, "paged", whole)  # the whole batch's working set alone fills it
    cfg, plan, costs, budgets, bw, source = _estimated_plan(tight, blueprint(tight), args)
    assert cfg.train.micro_batch_size < BATCH and plan.peak_bytes["device"] <= whole
    text = "\n".join(report(cfg, plan, costs, budgets, bw, source, 100e12))
    mfu = models.get(cfg.model).flops_per_token * BATCH * cfg.model.seq_len / (plan.predicted.step_time * 100e12)
    assert predicted_mfu(cfg, plan, 100e12) == pytest.approx(mfu)
    bound, shares = plan.bound(costs[0].name)
    assert shares[bound] == max(shares.values()) > 0
    step = step_lines(cfg, plan, costs, source, 100e12)  # a headline, then short lines of what is behind it
    assert step[0] == f"  predicted step time   {plan.predicted.step_time:.4g} s, {mfu:.1%} MFU, bound by {bound}"
    assert "\n".join(step) in text and all(len(line) <= 100 for line in step), step
    labels = {line[4:24].strip() for line in step[1:]}
    assert {"figures", "without overlap", "streams busy", "MFU"} <= labels, step


def test_bad_micro_batch_sizes_are_refused_by_key():
    base = {"train": {"batch_size": 8}}
    for micro, words in [(-1, "must be >= 0"), (3, "not a multiple")]:
        with pytest.raises(ConfigError, match=r"'train\.micro_batch_size'.*" + words):
            config_from_dict({"train": {**base["train"], "micro_batch_size": micro}})
    train = config_from_dict({"train": {"batch_size": 8, "micro_batch_size": 2}}).train
    assert train.micro_batches() == 4 and train.micro_batches(2) == 2 and train.micro_batches(4) == 1
    with pytest.raises(ConfigError, match=r"'train\.batch_size'=8 .* 'train\.micro_batch_size'=2 x 8"):
        train.micro_batches(8)  # 8 ranks: 16 sequences per micro-batch step, more than the batch
    assert dataclasses.replace(train, micro_batch_size=0).micro_batches(8) == 1


@pytest.mark.compares_programs
@pytest.mark.slow
def test_data_parallel_micro_batches_reduce_the_gradients_once_per_step():
    """Two devices: every micro-batch split over both ranks, per-rank sums, one gradient reduction per step."""
    from conftest import comparing_env  # (here: micro_dp_check.py imports this module, not the test set-up)

    script = Path(__file__).with_name("micro_dp_check.py")
    run = subprocess.run(["timeout", "-s", "KILL", "300", sys.executable, str(script)], capture_output=True,
                         text=True, cwd=Path(__file__).resolve().parents[1], env=comparing_env())
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["all_reduce"] >= 1 and out["all_reduce_in_loop"] == 0, out
    np.testing.assert_allclose(out["losses"][str(MICRO)], out["losses"]["0"], rtol=1e-5)


def test_the_paged_engine_halves_a_whole_batch_the_device_cannot_hold():
    """train.micro_batch_size 0: the whole batch when its working set fits the device budget, else the largest
    halving that fits (judged from shapes, before anything is profiled); too small a budget is left to the plan's
    refusal."""
    from angel_jax.schedule.plan import minimum_device_bytes

    cpu = jax.devices()[0]
    sizes = blueprint(_cfg(0, "paged")).sizes
    assert budgets_lib.fit_micro_batch(_cfg(0, "paged", 10**9), cpu, sizes).train.micro_batch_size == 0
    need = {size: minimum_device_bytes(sizes.stages, budgets_lib.budgets_for(_cfg(size, "paged"), cpu, BATCH, sizes),
                                       BATCH // size)
            for size in (8, 4, 2, 1)}
    assert need[8] > need[4] > need[2]
    assert budgets_lib.fit_micro_batch(_cfg(0, "paged", need[4]), cpu, sizes).train.micro_batch_size == 4
    assert budgets_lib.fit_micro_batch(_cfg(0, "paged", need[2]), cpu, sizes).train.micro_batch_size == 2
    assert budgets_lib.fit_micro_batch(_cfg(0, "paged", need[1] - 1), cpu, sizes).train.micro_batch_size == 0
