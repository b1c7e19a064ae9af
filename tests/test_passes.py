"""Accumulation passes (`memory.passes`): a step's M micro-batches run in P layer-major passes of M/P each. The
paged engine then trains as with one pass (the same losses, gradient norms and parameters as the in-memory engine,
to float rounding: only the order of the gradient sums differs), fetches every streamed stage P times as often,
and sums the streamed stages' gradients on the host between passes; a number of passes that does not divide the
micro-batches is refused by key."""

from __future__ import annotations

import functools
from collections import Counter

import jax
import numpy as np
import pytest

from angel_jax.config import Config, MemoryConfig, ModelConfig, OptimizerConfig, TrainConfig
from angel_jax.schedule.runtime import build_paged_runtime
from angel_jax.schedule.plan import Budgets, PlanError, fetches_per_step, make_plan
from angel_jax.schedule.simulate import Bandwidths, StageCost, simulate
from angel_jax.schedule.stagefns import HostSums
from angel_jax.train.engines import InMemoryEngine
from pinned_costs import pin_costs
from test_paged import batches

# As in test_micro_batches.py: narrow and deep enough that a small device budget streams most stages; SGD with
# clipping, so a gradient off by a factor (a pass's gradients lost, a missing 1/M) or a norm of part of the
# micro-batches changes the trajectory.
MODEL = ModelConfig(d_model=64, n_layers=6, n_heads=2, seq_len=16, compute_dtype="float32")
PAGE = 49 * 4096  # one page per block
BATCH, MICRO, STEPS, PASSES = 8, 2, 3, 2  # 4 micro-batches per step, in 2 passes
STREAMING_BUDGET = 1_900_000  # bytes: activations, a window of streamed stages, the embedding resident


def _cfg(mode: str = "in_memory", passes: int = 0, budget: int = 0) -> Config:
    return Config(model=MODEL, optimizer=OptimizerConfig(name="sgd", lr=0.3, warmup_steps=1, grad_clip=0.5),
                  train=TrainConfig(steps=STEPS, batch_size=BATCH, micro_batch_size=MICRO),
                  memory=MemoryConfig(mode=mode, page_size=PAGE, device_budget=budget, passes=passes))


def _data() -> list[jax.Array]:
    return batches(STEPS, MODEL, BATCH)


@functools.lru_cache(maxsize=1)
def _in_memory() -> tuple[list[dict], object, object]:
    """The in-memory engine with the same micro-batches: metrics of every step, final and initial parameters."""
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    engine = InMemoryEngine(_cfg(), mesh)
    initial = jax.tree.map(np.array, engine.state.params)  # a copy: the engine donates its state
    try:
        metrics = [{k: float(v) for k, v in engine.step(b).items()} for b in _data()]
        return metrics, jax.tree.map(np.asarray, engine.state.params), initial
    finally:
        engine.close()


def _paged(passes: int, drop_pass: int | None = None) -> tuple[list[dict], object, object, Counter]:
    """Metrics, final parameters, the engine and the last step's parameter-page fetches of a paged run with
    `passes` passes; `drop_pass`: streamed stages' gradients of that pass are not added on the host (a broken
    accumulation, which the comparison must catch)."""
    engine = build_paged_runtime(_cfg("paged", passes, STREAMING_BUDGET), _in_memory()[2], _data()[0])
    fetches: Counter = Counter()
    prefetch, params_pages = engine.store.prefetch, engine.model.params_layout.num_pages

    def counted_prefetch(pid, to="device", keep_source=False):
        if to == "device" and pid < params_pages:
            fetches[pid] += 1
        return prefetch(pid, to, keep_source)

    engine.store.prefetch = counted_prefetch
    if drop_pass is not None:
        engine.executor._host_sums = _Dropping(engine.executor._host_sums, drop_pass, len(engine.plan.streamed))
    try:
        metrics = []
        for n, b in enumerate(_data()):
            if n == STEPS - 1:  # the last step alone
                fetches.clear()
            metrics.append(engine.executor.step(b))
        step_fetches = Counter(fetches)
        metrics = [{k: float(v) for k, v in m.items()} for m in metrics]
        params = engine.executor.params()
    finally:
        engine.close()
    return metrics, params, engine, step_fetches


class _Dropping:
    """Host sums that leave out the gradients of one pass (counted by the adds: `stages` adds per pass)."""

    def __init__(self, sums: HostSums, drop: int, stages: int):
        self._sums, self._drop, self._stages, self._adds = sums, drop, stages, 0

    def accumulate(self, acc, dpages, dtypes):
        n, self._adds = self._adds, self._adds + 1
        if acc is not None and n // self._stages % PASSES == self._drop:
            return acc
        return self._sums.accumulate(acc, dpages, dtypes)

    def mean_grads(self, acc, micro_batches, dtypes):
        return self._sums.mean_grads(acc, micro_batches, dtypes)


def _assert_matches(metrics: list[dict], params, ref: list[dict], ref_params, rtol: float = 1e-5) -> None:
    for key in ("loss", "grad_norm", "update_norm"):
        np.testing.assert_allclose([m[key] for m in metrics], [m[key] for m in ref], rtol=rtol, err_msg=key)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * float(np.max(np.abs(want))))


@pytest.mark.compares_programs
def test_passes_train_as_one_pass_and_fetch_streamed_stages_once_per_pass(monkeypatch):
    pin_costs(monkeypatch)  # the placement asserted below is the planner's choice from stage times: not the load's
    ref, ref_params, _ = _in_memory()
    one, one_params, e1, fetches1 = _paged(1)
    two, two_params, e2, fetches2 = _paged(PASSES)
    assert e1.plan.passes == 1 and e2.plan.passes == PASSES and e2.plan.micro_batches == BATCH // MICRO
    assert len(e2.plan.streamed) >= len(e2.plan.home) - 2, "most stages must stream"
    assert all(g == "host" for i, g in enumerate(e2.plan.grad_home) if i in e2.plan.streamed)
    assert ref[-1]["loss"] < ref[0]["loss"] - 0.2, "the toy stream must be learnable"
    for metrics, params in ((one, one_params), (two, two_params)):
        _assert_matches(metrics, params, ref, ref_params)
    # Every pass fetches every streamed stage for each of its accesses (with the embedding resident, no stage is
    # used at the end of one pass and the start of the next, where its pages would stay on the device).
    assert 0 not in e2.plan.streamed
    assert fetches1 == {p: 1 if i == len(e1.plan.home) - 1 else 2 for i in e1.plan.streamed
                        for p in e1.model.param_ids(i)}
    assert e1.plan.streamed == e2.plan.streamed and fetches2 == {p: PASSES * n for p, n in fetches1.items()}
    # The planner's count of fetches (what its I/O and timeline charge) is the executor's.
    for e, fetches in ((e1, fetches1), (e2, fetches2)):
        planned = fetches_per_step(len(e.plan.home), e.plan.passes, e.plan.prefetch)
        assert fetches == {p: planned[i] for i in e.plan.streamed for p in e.model.param_ids(i)}


@pytest.mark.compares_programs
def test_a_pass_left_out_of_the_host_sums_is_caught():
    ref, ref_params, _ = _in_memory()
    broken, broken_params, _, _ = _paged(PASSES, drop_pass=1)
    with pytest.raises(AssertionError, match="Not equal to tolerance"):
        _assert_matches(broken, broken_params, ref, ref_params)


def test_passes_that_do_not_divide_the_micro_batches_are_refused_by_key():
    with pytest.raises(PlanError, match=r"memory\.passes=3 does not divide the step's 4 micro-batches"):
        build_paged_runtime(_cfg("paged", 3, STREAMING_BUDGET), None, _data()[0])


def test_the_predicted_step_spans_every_pass():
    """With every stage resident, passes only cut the step into parts: the same predicted step, and the planner
    (choosing) keeps one pass."""
    costs = [StageCost(f"s{i}", 1000, 2000, 0.01, 0.03, 0.001, 0.002, 0.0005) for i in range(4)]
    home = ("device",) * 4
    one = simulate(costs, Bandwidths(), home, home, 1, micro_batches=4)
    for passes in (2, 4):
        np.testing.assert_allclose(simulate(costs, Bandwidths(), home, home, 1, micro_batches=4,
                                            passes=passes).step_time, one.step_time, rtol=1e-9)
    plan = make_plan(costs, Bandwidths(), Budgets(device=10**9, host=None, disk=0, fixed_device=0),
                     micro_batches=4)
    assert plan.passes == 1 and not plan.streamed


def test_a_host_too_small_for_the_gradient_sums_is_named_not_the_device():
    """Passes keep the streamed stages' gradient sums on the host: when that is what no plan fits, the refusal
    says so (it blamed the device, with a negative number of bytes 'missing')."""
    costs = [StageCost(f"s{i}", 10**6, 2 * 10**6, 0.01, 0.03, 0.001, 0.002, 0.0005) for i in range(6)]
    budgets = Budgets(device=4 * 10**6, host=3 * 10**6, disk=10**9, fixed_device=10**6, saved_device=8 * 10**5)
    with pytest.raises(PlanError, match=r"host budget 3,000,000 B .* every streamed stage's gradients, summed on the "
                                        r"host between the step's 4 accumulation passes"):
        make_plan(costs, Bandwidths(), budgets, micro_batches=4, passes=4)
