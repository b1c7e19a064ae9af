"""Saved stage inputs parked in pinned host memory between a forward and its backward (`memory.activations`): the
arithmetic is unchanged, the device holds a window of stage inputs instead of a pass's, so a batch whose inputs
the device cannot hold runs in one pass (each streamed stage fetched once per access) within the budget, and the
planner weighs parking against accumulation passes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_paged import _cfg, assert_same_training, batches, device_use, paged, state_bytes

from angel_jax.config import Config
from angel_jax.schedule.plan import Budgets, PlanError, io_per_step, make_plan
from angel_jax.schedule.simulate import Bandwidths, StageCost
from angel_jax.schedule.staging import ACTIVATIONS_IN_FLIGHT

MB = 2**20


def _config(activations: str, batch: int, micro: int, budget_fraction: float = 0.25, **memory) -> Config:
    cfg = _cfg("adamw")
    return dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, batch_size=batch, micro_batch_size=micro),
        memory=dataclasses.replace(cfg.memory, device_budget=int(state_bytes(cfg) * budget_fraction),
                                   activations=activations, **memory))


@pytest.mark.parametrize("batch, micro", [(2, 0), (4, 1)])
def test_parked_inputs_give_the_same_training(batch, micro):
    data = batches(5, batch=batch)
    *kept_run, kept = paged(_config("device", batch, micro), data)
    *run, engine = paged(_config("host", batch, micro), data)
    assert engine.plan.parked_bytes > 0 and kept.plan.parked_bytes == 0
    assert engine.plan.fixed_device < kept.plan.fixed_device
    assert_same_training(run, kept_run)


@pytest.mark.compares_programs
def test_a_batch_the_device_cannot_hold_runs_in_one_pass_within_the_budget():
    """32 sequences in micro-batches of 4: their stage inputs (3.3 MB) are most of the device budget (three
    tenths of the model state, 4.7 MB). Kept on the device the step needs accumulation passes, each fetching every
    streamed stage again; parked, one pass, and what is alive on the device stays within the budget."""
    data = batches(3, batch=32)
    kept = _config("device", 32, 4, budget_fraction=0.3)
    parked = _config("host", 32, 4, budget_fraction=0.3)
    used, (losses, _, engine) = device_use(parked, data)
    plan = engine.plan
    assert plan.passes == 1 and plan.parked_bytes > 0 and len(plan.streamed) >= 0.75 * len(plan.home)
    assert used <= parked.memory.device_budget, (used, parked.memory.device_budget)
    kept_losses, _, kept_engine = paged(kept, data)
    assert kept_engine.plan.passes > 1
    # (the passes sum the micro-batches' gradients in another order: equal to float rounding)
    np.testing.assert_allclose(losses, kept_losses, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- the planner
def _costs(n: int = 8) -> list[StageCost]:
    """n stages of 4 MiB of parameters (8 MiB of Adam state), 1 ms forward, 2.5 ms backward per micro-batch."""
    return [StageCost(f"s{i}", 4 * MB, 8 * MB, 0.001, 0.0025, 0.001, 0.004) for i in range(n)]


LINK = Bandwidths(h2d=0.5e9, d2h=0.5e9, disk_read=1e9, disk_write=1e9)  # a fetch takes about an access's compute
# Stage inputs of 8 micro-batches: 14 MiB (2 MiB a stage for the 7 stages that save theirs); with them the device
# cannot also hold the streaming window in one pass.
ACTS = Budgets(device=24 * MB, host=None, disk=0, fixed_device=18 * MB, saved_device=14 * MB)


def test_auto_parks_where_the_alternative_is_passes_that_fetch_every_stage_again():
    costs = _costs()
    kept = make_plan(costs, LINK, ACTS, micro_batches=8, activations="device")
    parked = make_plan(costs, LINK, ACTS, micro_batches=8, activations="host")
    auto = make_plan(costs, LINK, ACTS, micro_batches=8, activations="auto")
    assert kept.passes > 1 and kept.parked_bytes == 0
    assert parked.passes == 1 and parked.parked_bytes == 2 * MB
    # The device holds the inputs in flight out, the one in use and those the prefetch brings back.
    assert parked.fixed_device == 4 * MB + (ACTIVATIONS_IN_FLIGHT + 1 + parked.prefetch) * 2 * MB
    assert parked.peak_bytes["device"] <= ACTS.device and parked.peak_bytes["host"] >= 14 * MB
    assert parked.predicted.step_time < 0.9 * kept.predicted.step_time
    assert (auto.passes, auto.parked_bytes) == (1, 2 * MB)
    io = parked.io_per_step(costs, LINK)
    plain = io_per_step(costs, LINK, parked.home, parked.grad_home, parked.opt_home, 1, parked.prefetch)
    assert io["h2d_bytes"] - plain["h2d_bytes"] == io["d2h_bytes"] - plain["d2h_bytes"] == 14 * MB
    events = parked.predicted.events
    assert {e.stream for e in events if e.label.startswith("park ")} == {"d2h"}
    assert {e.stream for e in events if e.label.startswith("unpark ")} == {"h2d"}
    # Shared cores (the CPU backend): auto keeps them on the device.
    assert make_plan(costs, LINK, ACTS, micro_batches=8, activations="auto", shared_cpu=True).parked_bytes == 0


def test_parked_inputs_count_in_the_host_budget_and_a_refusal_says_they_were_parked():
    costs = _costs()
    parked = make_plan(costs, LINK, ACTS, micro_batches=8, activations="host")
    no_room = dataclasses.replace(ACTS, host=parked.peak_bytes["host"] - 1)
    plan = make_plan(costs, LINK, no_room, micro_batches=8, activations="auto")
    assert plan.parked_bytes == 0 and plan.passes > 1  # no host memory for them: passes instead
    tiny = dataclasses.replace(ACTS, device=16 * MB)
    with pytest.raises(PlanError, match="stage inputs parked in host memory"):
        make_plan(costs, LINK, tiny, micro_batches=8, activations="host")
