"""Streamed stages updated on the device (`memory.streamed_updates`): their pages live in host memory, their
parameters, gradients and optimizer state cross to the device for the update and the new pages cross back. The
arithmetic is the host update's (the same losses and parameters), at most `DEVICE_UPDATES_IN_FLIGHT` stages'
pages are on the device at a time within the budget, those stages never run one update behind, and the planner
chooses the device where its link outruns the host's update, and says so."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from test_paged import _cfg, assert_same_training, batches, device_use, paged, reference, state_bytes

from angel_jax.config import Config, ConfigError, load_config
from angel_jax.schedule.plan import Budgets, PlanError, io_per_step, make_plan
from angel_jax.schedule.simulate import Bandwidths, StageCost, simulate
from angel_jax.schedule.staging import DEVICE_UPDATES_IN_FLIGHT

ROOT = Path(__file__).resolve().parents[1]
MB = 2**20


def _memory(cfg: Config, **memory) -> Config:
    return dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, **memory))


def _quarter(streamed_updates: str, **memory) -> Config:
    """A quarter of the state's bytes on the device: most stages stream, with room for two stages' updates."""
    cfg = _cfg("adamw")
    return _memory(cfg, device_budget=state_bytes(cfg) // 4, streamed_updates=streamed_updates, **memory)


@pytest.mark.compares_programs
def test_streamed_stages_updated_on_the_device_train_exactly_as_on_the_host():
    data = batches(6)
    *host_run, host = paged(_quarter("host"), data)
    *run, engine = paged(_quarter("device"), data)
    plan = engine.plan
    assert not host.plan.streamed_device_updates
    assert len(plan.streamed_device_updates) == len(plan.streamed) >= 0.75 * len(plan.home)
    assert {s.placement for s in engine.updater.slots if s.where == "host"} == {"device_for_host"}
    np.testing.assert_allclose(run[0], reference(_quarter("device"), data)[0], rtol=1e-5)
    assert_same_training(run, host_run)


@pytest.mark.parametrize("batch", [2, 4])
def test_sums_over_accumulation_passes_are_added_on_the_device_as_on_the_host(batch):
    """Two passes of one micro-batch each (gradients as they are) or of two (their float32 sums): a stage updated
    on the device adds each later pass into its sum there, with the host's arithmetic."""
    data = batches(4, batch=batch)

    def two_passes(where: str) -> Config:
        cfg = _quarter(where, passes=2)
        return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=batch, micro_batch_size=1))

    *host_run, host = paged(two_passes("host"), data)
    *run, engine = paged(two_passes("device"), data)
    assert engine.plan.passes == 2 and not host.executor._summed_on_device
    assert engine.executor._summed_on_device == set(engine.plan.streamed) != set()
    assert_same_training(run, host_run)


def test_stages_updated_on_the_device_never_run_one_update_behind():
    """Lock-free mode lets host updates run one step behind; a stage updated on the device is exact, so a run with
    every streamed stage updated there gives exact mode's losses and no stale use."""
    data = batches(5)
    exact, _, _ = paged(_quarter("device"), data)
    losses, _, engine = paged(_quarter("device", staleness=1), data)
    assert engine.updater.stale_uses == 0 and engine.updater.max_lag <= 1
    assert losses == exact


def test_a_checkpoint_of_a_run_updating_on_the_device_resumes_it_exactly(tmp_path):
    """The state after 3 steps (the step counts of device-updated stages live on the device) loaded into a new
    engine trains on as the uninterrupted run, stage inputs parked as well."""
    from angel_jax.train.paged import PagedTrainEngine

    cfg = _quarter("device", activations="host")
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, run_dir=str(tmp_path / "run")))
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1], axis_types=(jax.sharding.AxisType.Auto,))
    data = batches(6)

    def steps(engine, part) -> list[float]:
        return [float(engine.step(jax.device_put(b, engine.batch_sharding))["loss"]) for b in part]

    first = PagedTrainEngine(cfg, mesh)
    try:
        assert first.built.plan.streamed_device_updates and first.built.plan.parked_bytes
        straight = steps(first, data)
    finally:
        first.close()
    again = PagedTrainEngine(cfg, mesh)
    try:
        steps(again, data[:3])
        arrays = {k: np.array(v) for k, v in again.state_snapshot().arrays.items()}
        meta = json.loads(json.dumps(again.state_meta()))
    finally:
        again.close()
    resumed = PagedTrainEngine(cfg, mesh)
    try:
        resumed.load_state(arrays, meta)
        assert steps(resumed, data[3:]) == straight[3:]
    finally:
        resumed.close()


def test_the_device_budget_holds_with_updates_in_flight():
    """Sampled between stage calls while the previous step's updates cross (the updater works beside the next
    step's forward): what is alive on the device fits the budget, the update pages included, and the plan reserves
    room for them. (The updater's bound of two stages in flight is not seen here: the CPU's copies land at once.)"""
    cfg = _quarter("device")
    used, (_, _, engine) = device_use(cfg, batches(4))
    assert engine.plan.update_bytes > 0 and engine.plan.peak_bytes["device"] <= cfg.memory.device_budget
    assert 2 * max(c.param_bytes for c in engine.costs) < used <= cfg.memory.device_budget, \
        (used, cfg.memory.device_budget)


# ---------------------------------------------------------------------------------------------- the planner
def _costs(n: int = 8, update_host_s: float = 0.050) -> list[StageCost]:
    """n stages of 4 MiB of parameters (8 MiB of Adam state), 10 ms forward, 25 ms backward, device updates of
    1 ms; host updates of `update_host_s`."""
    return [StageCost(f"s{i}", 4 * MB, 8 * MB, 0.010, 0.025, 0.001, update_host_s) for i in range(n)]


FAST_LINK = Bandwidths(h2d=20e9, d2h=20e9, disk_read=1e9, disk_write=1e9)
ROOM = Budgets(device=56 * MB, host=None, disk=0, fixed_device=4 * MB)  # a few stages resident at most


def test_auto_updates_on_the_device_where_the_link_outruns_the_host_update():
    costs = _costs()
    host = make_plan(costs, FAST_LINK, ROOM, streamed_updates="host")
    device = make_plan(costs, FAST_LINK, ROOM, streamed_updates="device")
    auto = make_plan(costs, FAST_LINK, ROOM, streamed_updates="auto")
    assert host.streamed and not host.streamed_device_updates and host.update_bytes == 0
    assert device.streamed_device_updates == device.streamed
    # A stage's update pages: its parameters, gradients and optimizer state, for two stages.
    assert device.update_bytes == DEVICE_UPDATES_IN_FLIGHT * (2 * 4 + 8) * MB
    assert device.peak_bytes["device"] <= ROOM.device
    # The host's 8 x 50 ms of updates per step bound it; on the device the compute (8 x 35 ms) does.
    assert host.predicted.step_time > 0.45 and device.predicted.step_time < 1.05 * 8 * 0.035
    assert auto.update_at == device.update_at and auto.predicted.step_time == device.predicted.step_time
    # A host update faster than the crossing: auto keeps the host.
    quick = _costs(update_host_s=0.0005)
    assert not make_plan(quick, FAST_LINK, ROOM, streamed_updates="auto").streamed_device_updates
    # Shared cores (the CPU backend): the "device" is the host's cores, nothing to gain.
    assert not make_plan(costs, FAST_LINK, ROOM, streamed_updates="auto", shared_cpu=True).streamed_device_updates


def test_the_crossings_are_on_the_links_and_the_next_step_waits_for_them():
    costs = _costs(4)
    plan = make_plan(costs, FAST_LINK, ROOM, streamed_updates="device")
    io = plan.io_per_step(costs, FAST_LINK)
    on_host = io_per_step(costs, FAST_LINK, plan.home, plan.grad_home, plan.opt_home, plan.passes, plan.prefetch)
    streamed = len(plan.streamed)
    # Beside the fetches and the gradients: each stage's parameters, gradients and state in, new parameters and
    # state out.
    assert io["h2d_bytes"] - on_host["h2d_bytes"] == streamed * (4 + 4 + 8) * MB
    assert io["d2h_bytes"] - on_host["d2h_bytes"] == streamed * (4 + 8) * MB
    assert on_host["d2h_bytes"] == streamed * 4 * MB
    tl = simulate(costs, FAST_LINK, plan.home, plan.opt_home, plan.prefetch, update_at=plan.updates, steps=2)
    name = costs[plan.streamed[0]].name

    def named(label: str) -> list:
        return sorted((e for e in tl.events if e.label == label), key=lambda e: e.start)

    assert {e.stream for e in named(f"update in {name}")} == {"h2d"}
    assert {e.stream for e in named(f"update out {name}")} == {"d2h"}
    assert {e.stream for e in named(f"update {name}")} == {"update"}
    # Exact: the next step fetches the stage's new parameters once they are home.
    home = named(f"update out {name}")[0]
    later = [e for e in named(f"fetch {name}") if e.start >= home.start]
    assert later and later[0].start >= home.end


def test_the_next_steps_fetches_go_between_the_updates_crossings():
    """The updater issues the stages' crossings one after the other, two stages in flight, while the training
    thread issues the next step's fetches: each copy stream runs its copies in the order they were issued, so the
    next step's first fetch does not wait behind every stage's update coming in."""
    costs = _costs(8)
    plan = make_plan(costs, FAST_LINK, ROOM, streamed_updates="device")
    assert len(plan.streamed) >= 4
    tl = simulate(costs, FAST_LINK, plan.home, plan.opt_home, plan.prefetch, update_at=plan.updates, steps=2)
    first, last = (costs[plan.streamed[k]].name for k in (0, -1))

    def starts(label: str) -> list[float]:
        return sorted(e.start for e in tl.events if e.label == label)

    crossing_in = starts(f"update in {last}")[0]  # step 1's update of the last streamed stage
    next_fetch = [t for t in starts(f"fetch {first}") if t > starts(f"update out {first}")[0]][0]
    assert next_fetch < crossing_in
    for stream in ("h2d", "d2h"):  # one copy at a time on each stream
        events = sorted((e for e in tl.events if e.stream == stream), key=lambda e: e.start)
        assert all(b.start >= a.end - 1e-12 for a, b in zip(events, events[1:]))


def test_with_passes_the_sums_cross_the_link_instead_of_the_host_adding_them():
    costs = _costs(4)
    plan = make_plan(costs, FAST_LINK, ROOM, streamed_updates="device", micro_batches=4, passes=2)
    host = make_plan(costs, FAST_LINK, ROOM, streamed_updates="host", micro_batches=4, passes=2)
    on_device = plan.predicted.events
    assert not [e for e in on_device if e.label.startswith("add ")]
    assert {e.stream for e in on_device if e.label.startswith("sum in ")} == {"h2d"}
    assert [e for e in host.predicted.events if e.label.startswith("add ")]
    io = plan.io_per_step(costs, FAST_LINK)
    plain = io_per_step(costs, FAST_LINK, plan.home, plan.grad_home, plan.opt_home, plan.passes, plan.prefetch)
    assert io["h2d_bytes"] - plain["h2d_bytes"] == len(plan.streamed) * (16 + 4) * MB  # the update's, a sum's


def test_stages_with_pages_on_disk_update_on_the_host_and_zero_pages_may_update_on_the_device():
    costs = _costs()
    cramped = Budgets(device=56 * MB, host=100 * MB, disk=None, fixed_device=4 * MB)
    plan = make_plan(costs, FAST_LINK, cramped, streamed_updates="device")
    on_disk = [i for i in plan.streamed if "disk" in (plan.home[i], plan.grad_home[i], plan.opt_home[i])]
    assert on_disk and all(plan.updates[i] == "host" for i in on_disk)
    assert set(plan.streamed_device_updates) == set(plan.streamed) - set(on_disk)
    # ZeRO-3 pages: each rank's host shards cross to its own device for the update (tests/zero_mp_check.py runs it).
    sharded = make_plan(costs, FAST_LINK, dataclasses.replace(ROOM, device=80 * MB), streamed_updates="device",
                        ranks=2)  # (the room for two ranks' gathered stages beside two updates in flight)
    assert sharded.streamed and set(sharded.streamed_device_updates) == set(sharded.streamed)


def test_a_budget_without_room_for_the_update_pages_says_so():
    tight = Budgets(device=17 * MB, host=None, disk=0, fixed_device=4 * MB)  # the streaming window, no more
    make_plan(_costs(), FAST_LINK, tight, streamed_updates="host")
    with pytest.raises(PlanError, match=r"2 stages updated on the device 33,554,432 B.*memory.streamed_updates=host"):
        make_plan(_costs(), FAST_LINK, tight, streamed_updates="device")


def test_the_config_names_a_wrong_placement():
    with pytest.raises(ConfigError, match="streamed_updates"):
        load_config(ROOT / "experiments" / "gpt_tiny.yaml", ["memory.streamed_updates=gpu"])
