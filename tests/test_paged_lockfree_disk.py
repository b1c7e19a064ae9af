"""Lock-free updates where the disk is (`memory.staleness: 1` with every page family of the streamed stages on
disk): such stages run one update behind while their read-update-write overlaps the next step, never more than
one, and the result is exactly a one-step-delayed gradient where they ran behind (replayed whole, as in
test_paged_lockfree.py). Their parameters have two sets of pages on disk: the version in use stays readable while
the next is written. A checkpoint of such a run holds the state of its step, bit for bit, and resumes exactly."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from angel_jax.train.paged import PagedTrainEngine
from test_paged_lockfree import BATCH, _cfg, _replayed, stdlib_windows

STEPS = 12
DEVICE_BUDGET = 3_200_000  # test_paged_lockfree's: every stage streams
HOST_BUDGET = 2_600_000  # the host window of every streamed page on disk (lock-free: 2,408,448 B), and not much more


def _disk_cfg(tmp_path, staleness: int):
    disk = tmp_path / f"disk{staleness}"
    disk.mkdir(parents=True, exist_ok=True)
    cfg = _cfg(staleness)  # (its optimizer, schedule and model: the replay's)
    memory = dataclasses.replace(cfg.memory, host_budget=HOST_BUDGET, disk_dir=str(disk))
    train = dataclasses.replace(cfg.train, run_dir=str(tmp_path / f"run{staleness}"))
    return dataclasses.replace(cfg, memory=memory, train=train)


def _mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((1,), ("data",), devices=jax.devices()[:1], axis_types=(jax.sharding.AxisType.Auto,))


def _data(steps: int) -> list[jax.Array]:
    windows = stdlib_windows(steps * BATCH, seed=0)
    return [jnp.asarray(windows[k * BATCH:(k + 1) * BATCH]) for k in range(steps)]


def _recording(engine: PagedTrainEngine) -> dict:
    """Records the executor's own acquire calls: (step, stage) -> whether the stage ran one update behind."""
    stale: dict[tuple[int, int], bool] = {}
    updater = engine.built.updater
    acquire = updater.acquire

    def recorded(i: int, step: int) -> bool:
        stale[step, i] = answer = bool(acquire(i, step))
        return answer

    updater.acquire = recorded
    return stale


def _all_disk(engine: PagedTrainEngine) -> None:
    plan = engine.built.plan
    assert len(plan.streamed) == len(plan.home), "every stage should stream"
    for family in (plan.home, plan.grad_home, plan.opt_home):
        assert set(family) == {"disk"}, (plan.home, plan.grad_home, plan.opt_home)


@pytest.mark.compares_programs  # (the replay is the whole-model program)
def test_disk_homed_stages_run_one_update_behind_as_a_delayed_gradient(tmp_path):
    data = _data(STEPS)
    engine = PagedTrainEngine(_disk_cfg(tmp_path, 1), _mesh())
    try:
        _all_disk(engine)
        stale = _recording(engine)
        losses = [float(engine.step(jax.device_put(b, engine.batch_sharding))["loss"]) for b in data]
        updater = engine.built.updater
        stale_uses, max_lag = updater.stale_uses, updater.max_lag
        # Two sets of parameter pages per disk-homed stage (and two of gradients): the files on disk are what the
        # plan counted.
        plan, costs = engine.built.plan, engine.built.costs
        assert plan.peak_bytes["disk"] == sum(4 * c.param_bytes + c.opt_bytes for c in costs)
        updater.drain()  # (lock-free: the last step's updates may still be writing pages when the step returns)
        engine.built.store.wait_all()
        files = Path(engine.built.store.tiers["disk"].root).rglob("c.*")
        assert sum(f.stat().st_size for f in files) == plan.peak_bytes["disk"]
    finally:
        engine.close()
    # Stages whose every page lives on disk ran behind their updates, and never by more than one step.
    assert stale_uses > 0 and sum(stale.values()) == stale_uses, stale_uses
    assert max_lag == 1
    # Exactly a one-step-delayed gradient where (and only where) they ran behind.
    np.testing.assert_allclose(losses, _replayed(data, stale), rtol=1e-5)


def test_checkpoint_of_a_lock_free_disk_run_resumes_exactly(tmp_path):
    """A checkpoint taken after an odd number of steps (stages whose newest parameters are in their second set of
    pages) holds that step's state bit for bit, and a run resumed from it takes the next step as the uninterrupted
    run does: both find every update in place, so both run it exactly, to the same loss bit for bit."""
    data = _data(6)
    first = PagedTrainEngine(_disk_cfg(tmp_path, 1), _mesh())
    try:
        _all_disk(first)
        for b in data[:5]:
            first.step(jax.device_put(b, first.batch_sharding))
        arrays = {k: np.array(v) for k, v in first.state_snapshot().arrays.items()}
        meta = json.loads(json.dumps(first.state_meta()))
        expected = float(first.step(jax.device_put(data[5], first.batch_sharding))["loss"])
    finally:
        first.close()
    assert int(arrays["step"]) == 5
    second = PagedTrainEngine(_disk_cfg(tmp_path / "second", 1), _mesh())
    try:
        second.load_state(arrays, meta)
        loaded = second.state_snapshot().arrays
        assert sorted(loaded) == sorted(arrays)
        for key, value in arrays.items():
            assert np.asarray(loaded[key]).tobytes() == value.tobytes(), key
        got = float(second.step(jax.device_put(data[5], second.batch_sharding))["loss"])
        assert second.built.updater.stale_uses == 0
    finally:
        second.close()
    assert got == expected
