"""Lock-free updates (`memory.staleness: 1`): stages run one update behind while their update is written, the
lag never exceeds one step, the result is exactly a one-step-delayed gradient where stages ran behind, and
training still converges like exact mode."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from angel_jax.config import Config, MemoryConfig, ModelConfig, OptimizerConfig, TrainConfig
from angel_jax.optim import split_optimizer
from angel_jax.optim.guard import StepControls
from angel_jax.schedule.runtime import build_paged_runtime
from angel_jax.train.step import TrainState, init_state, make_step_phases
import models
from models import gpt
from test_paged import PAGE

MODEL = ModelConfig(d_model=64, n_layers=8, n_heads=2, seq_len=32, compute_dtype="float32")
BATCH = 8
STEPS = 60
BUDGET = 3_200_000  # the step's minimum (activations + a window of 3 blocks), no room for a resident stage
# With nearly every stage one update behind (what this CPU gives: host updates share its two cores with the next
# step's compute), lock-free training is delayed-gradient Adam. How much a one-step delay costs after 120 steps
# grows with the learning rate: ~1% here at 5e-4, ~3% at 1e-3, ~10% at 3e-3 (measured; after 200 steps the same:
# ~1%, ~3%, ~12%, the figures of a whole-model delayed-gradient run, so they measure the algorithm, not the
# engine). 5e-4 is the regime the check is about. In 60 steps exact mode goes from 5.56 (the first batch) to 3.90
# on held-out text, lock-free to 3.93 (0.8% above; measured on 2026-12-02), where the check asks for 1.2 less and
# 2% apart (120 steps took twice the time for the same verdict: 3.22, ~1%).
LR = 5e-4


def _cfg(staleness: int, lock_free_from: int = 0) -> Config:
    """(lock-free from the first step unless told: these tests are about the stale steps)"""
    return Config(model=MODEL, optimizer=OptimizerConfig(name="adamw", lr=LR, warmup_steps=20),
                  train=TrainConfig(steps=STEPS, batch_size=BATCH),
                  memory=MemoryConfig(mode="paged", page_size=PAGE, device_budget=BUDGET, staleness=staleness,
                                      lock_free_from=lock_free_from))


def stdlib_windows(n: int, seed: int) -> np.ndarray:
    """n random windows of seq_len + 1 bytes of this Python's standard-library source: real text, on every machine."""
    root = Path(os.__file__).parent
    text = b"".join(f.read_bytes() for f in sorted(root.glob("*.py")))[:4_000_000]
    tokens = np.frombuffer(text, np.uint8).astype(np.int32)
    starts = np.random.default_rng(seed).integers(0, len(tokens) - MODEL.seq_len - 1, n)
    return np.stack([tokens[s:s + MODEL.seq_len + 1] for s in starts])


def _train(staleness: int, data: list[jax.Array], lock_free_from: int = 0) -> tuple[list[float], dict, object]:
    engine = build_paged_runtime(_cfg(staleness, lock_free_from), jax.tree.map(np.array, gpt.init(MODEL, 0)[1]),
                                 data[0])
    engine.stale = {}  # (step, stage) -> whether the stage ran without its previous update
    acquire = engine.updater.acquire

    def recording(i: int, step: int) -> bool:  # the executor's own call, its answer recorded
        engine.stale[step, i] = stale = bool(acquire(i, step))
        return stale

    engine.updater.acquire = recording
    try:
        metrics = [engine.executor.step(b) for b in data]
        losses = [float(m["loss"]) for m in metrics]
        assert np.isfinite([float(m["update_norm"]) for m in metrics]).all()
        params = engine.executor.params()  # after the last updates
    finally:
        engine.close()
    return losses, params, engine


def _replayed(data: list[jax.Array], stale: dict[tuple[int, int], bool]) -> list[float]:
    """The losses of a whole-model trainer that takes stage i's gradient of step t at the parameters before
    update t-1 wherever `stale` says the paged run ran stage i one update behind at step t, else at the current
    ones, and applies it to the current parameters: a clean one-step-delayed gradient, stage by stage."""
    cfg = _cfg(1)
    staged = models.get(MODEL)
    graphdef, params = staged.init(0)
    opt = split_optimizer(cfg.optimizer, cfg.train.steps)
    phases = make_step_phases(graphdef, opt, staged.loss)
    judge, apply = jax.jit(phases.judge), jax.jit(phases.apply)
    controls = StepControls().as_numpy()
    state = init_state(params, opt.tx)
    previous, losses = state.params, []
    for t, batch in enumerate(data):
        current, before = staged.split(state.params), staged.split(previous)
        mixed = staged.merge([before[i] if stale[t, i] else current[i] for i in range(len(current))])
        clipped, ok, metrics = judge(TrainState(state.step, mixed, state.opt_state), batch, controls)
        previous, state = state.params, apply(state, clipped, ok, controls)
        losses.append(float(metrics["loss"]))
    return losses


def _eval_loss(params: dict, held_out: np.ndarray) -> float:
    graphdef, _ = gpt.abstract_params(MODEL)
    logits = nnx.merge(graphdef, jax.tree.map(jnp.asarray, params))(jnp.asarray(held_out[:, :-1]))
    return float(gpt.cross_entropy(logits, jnp.asarray(held_out[:, 1:])))


@pytest.mark.compares_programs  # (the replay is the whole-model program)
def test_lock_free_training_runs_stale_and_converges_like_exact_mode():
    windows = stdlib_windows(STEPS * BATCH, seed=0)
    data = [jnp.asarray(windows[k * BATCH:(k + 1) * BATCH]) for k in range(STEPS)]
    held_out = stdlib_windows(256, seed=1)
    exact, exact_params, e0 = _train(0, data)
    lock_free, lock_free_params, e1 = _train(1, data)
    assert len(e1.plan.streamed) == len(e1.plan.home), "every stage should stream (host updates)"
    assert e0.updater.stale_uses == 0 and e0.updater.max_lag == 0
    # The stages really ran behind their updates, and never by more than one step.
    assert e1.updater.stale_uses > STEPS, e1.updater.stale_uses
    assert e1.updater.max_lag == 1
    assert lock_free[0] == exact[0] and lock_free[1:] != exact[1:]
    # Exactly a one-step-delayed gradient where the stages ran behind: each stage's forward and recomputing
    # backward read one version, its delayed gradient is applied once, to the newest parameters, with the current
    # optimizer state and the step's own global norm (any of those wrong moves a step's loss by 1e-3 or more).
    np.testing.assert_allclose(lock_free, _replayed(data, e1.stale), rtol=1e-5)
    # The loss after 60 steps, on held-out text (single training batches are too noisy to compare at 2%).
    final_exact, final_lock_free = _eval_loss(exact_params, held_out), _eval_loss(lock_free_params, held_out)
    assert final_exact < exact[0] - 1.2, "the model must learn"
    assert abs(final_lock_free - final_exact) <= 0.02 * final_exact, (final_lock_free, final_exact)


def test_lock_free_steps_start_at_lock_free_from_and_the_steps_before_are_exact():
    """`memory.lock_free_from: K`: steps 0..K-1 wait for every update (the losses are exact mode's), from step K
    stages run one update behind, and the whole run is the replayed delayed gradient from there on."""
    windows = stdlib_windows(12 * BATCH, seed=0)
    data = [jnp.asarray(windows[k * BATCH:(k + 1) * BATCH]) for k in range(12)]
    k = 6
    exact, _, _ = _train(0, data)
    late, _, engine = _train(1, data, lock_free_from=k)
    assert not any(stale for (step, _), stale in engine.stale.items() if step < k)
    assert sum(stale for (step, _), stale in engine.stale.items() if step >= k) > 0, engine.stale
    assert late[:k] == exact[:k]
    assert late[k:] != exact[k:]
    np.testing.assert_allclose(late, _replayed(data, engine.stale), rtol=1e-5)


def test_lock_free_updates_put_the_stages_updated_exactly_first():
    """The worker updates stages one at a time. In lock-free mode the next step may use a streamed stage before
    its update, but not a resident one (updated exactly, on the device): with the stages in plain order the head,
    resident and last, waited for every streamed stage's update (with optimizer state on disk, the whole disk
    chain) and the next step's head with it. Exact mode keeps stage order (the next step needs stage 0 first)."""
    data = [jnp.asarray(stdlib_windows(BATCH, seed=0))]
    params = jax.tree.map(np.array, gpt.init(MODEL, 0)[1])
    orders, exact = {}, {}
    for staleness in (0, 1):
        cfg = _cfg(staleness)
        cfg = dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, device_budget=3 * BUDGET))
        engine = build_paged_runtime(cfg, params, data[0])
        try:
            updater = engine.updater
            resident = set(range(len(updater.slots))) - set(engine.plan.streamed)
            exact[staleness] = tuple(i for i, slot in enumerate(updater.slots) if not updater._lock_free(slot))
            orders[staleness] = updater.order
            assert np.isfinite(float(engine.executor.step(data[0])["loss"]))
        finally:
            engine.close()
    n = len(orders[0])
    assert orders[0] == tuple(range(n)) and exact[0] == tuple(range(n))
    # (Whatever the plan made resident here: resident stages update exactly, and one of them, the head, comes
    # after stages that may run behind, so plain order would fail this.)
    assert resident and resident <= set(exact[1]) and max(exact[1]) > min(set(range(n)) - set(exact[1])), \
        (resident, exact[1])
    # and the others from the last back, as the backward releases them
    assert orders[1] == exact[1] + tuple(i for i in reversed(range(n)) if i not in exact[1]), (orders[1], exact[1])


def test_the_updater_keeps_at_most_pending_versions_for_stages_in_use():
    """Lock-free, host-homed parameters: an update that completes while its stage is in use is kept until the
    stage's release, a second version in host memory. Here every such stage is held (acquired for the next step
    before the last step's updates start): the worker keeps PENDING_VERSIONS of them, then waits for a release,
    and goes on as the stages are released, every update applied."""
    from angel_jax.schedule.staging import PENDING_VERSIONS

    data = [jnp.asarray(stdlib_windows(BATCH, seed=0))]
    engine = build_paged_runtime(_cfg(1), jax.tree.map(np.array, gpt.init(MODEL, 0)[1]), data[0])
    go = threading.Event()
    try:
        updater = engine.updater
        free = [i for i, slot in enumerate(updater.slots) if updater._lock_free(slot) and not slot.second_set]
        assert len(free) > PENDING_VERSIONS + 1, free
        run_step = updater._run_step

        def gated(*args):  # the worker starts step 0's updates once the test holds the stages
            go.wait()
            return run_step(*args)

        updater._run_step = gated
        assert np.isfinite(float(engine.executor.step(data[0])["loss"]))
        for i in free:  # step 1 may use them one update behind: held at once
            assert updater.acquire(i, 1)
        go.set()
        deadline = time.monotonic() + 120
        while sum(p is not None for p in updater._pending) < PENDING_VERSIONS and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the worker waits for a release: however long, it keeps no more
        with updater._cond:
            kept = sum(p is not None for p in updater._pending)
            assert kept == PENDING_VERSIONS and updater._busy == 1, (kept, updater._busy)
            assert sorted(updater._done[i] for i in free)[0] == 0  # an update still to run
        for i in free:
            updater.release(i)
            with updater._cond:
                assert sum(p is not None for p in updater._pending) <= PENDING_VERSIONS
        updater.drain()
        assert updater._done == [1] * len(updater.slots)
    finally:
        go.set()
        engine.close()


def test_lock_free_gradients_wait_in_the_backward_for_the_update_that_takes_the_previous_ones():
    """Lock-free, one pass: a stage's gradients of step 1 go to the host only once its step-0 update took the
    step-0 ones (the plan counts one set of host-homed gradients). With step 0's updates held back, step 1's
    backward stops at its first stage, nothing of step 1 handed over; released, step 1 completes."""
    data = [jnp.asarray(stdlib_windows(BATCH, seed=s)) for s in (0, 1)]
    engine = build_paged_runtime(_cfg(1), jax.tree.map(np.array, gpt.init(MODEL, 0)[1]), data[0])
    go = threading.Event()
    try:
        updater = engine.updater
        assert all(updater._lock_free(slot) and (slot.grad_home or slot.where) == "host" for slot in updater.slots)
        run_step, submit, make_room = updater._run_step, updater.submit, updater.make_room_for_grads
        submitted, waited = [], []
        updater._run_step = lambda *args: (go.wait(), run_step(*args))[1]
        updater.submit = lambda step, i, grads: (submitted.append((step, i)), submit(step, i, grads))[1]
        updater.make_room_for_grads = lambda i, step: (waited.append((step, i)), make_room(i, step))[1]
        assert np.isfinite(float(engine.executor.step(data[0])["loss"]))
        n = len(updater.slots)
        assert sorted(submitted) == [(0, i) for i in range(n)]
        out: dict = {}
        second = threading.Thread(target=lambda: out.update(engine.executor.step(data[1])), daemon=True)
        second.start()
        deadline = time.monotonic() + 120
        while not any(s == 1 for s, _ in waited) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # the backward waits for step 0's update of its first stage: however long, no further
        assert [w for w in waited if w[0] == 1] == [(1, n - 1)] and not [s for s in submitted if s[0] == 1]
        assert second.is_alive()
        go.set()
        second.join(120)
        assert not second.is_alive() and np.isfinite(float(out["loss"]))
        assert sorted(s for s in submitted if s[0] == 1) == [(1, i) for i in range(n)]
    finally:
        go.set()
        engine.close()


def test_a_step_that_fails_part_way_releases_the_stages_it_holds():
    """The updater waits for the release of stages in use (at most PENDING_VERSIONS new versions kept for them):
    a step that raises in its forward lets go of what it acquired, and the next step runs."""
    data = [jnp.asarray(stdlib_windows(BATCH, seed=0))]
    engine = build_paged_runtime(_cfg(1), jax.tree.map(np.array, gpt.init(MODEL, 0)[1]), data[0])
    try:
        updater, executor = engine.updater, engine.executor

        def fail(op: str, i: int) -> None:
            if op == "forward" and i == 3:
                raise RuntimeError("injected")

        executor.on_access = fail
        with pytest.raises(RuntimeError, match="injected"):
            executor.step(data[0])
        assert not any(updater._held)
        executor.on_access = None
        assert np.isfinite(float(executor.step(data[0])["loss"]))
    finally:
        engine.close()
