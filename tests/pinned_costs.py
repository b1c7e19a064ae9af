"""Fixed stage times and link bandwidths for tests that assert what the planner chose (a placement, a schedule):
profiled times follow the machine's load, so a busy machine would move a stage from resident to streamed. The
stage functions are still compiled and run once by the real profiler (their bytes and shapes are real); only the
seconds it measured are replaced, by figures computed from each stage's bytes, the same on every machine.

    pin_costs(monkeypatch)      # then build_paged_runtime(...) plans from the pinned figures
"""

from __future__ import annotations

import dataclasses

import pytest

from angel_jax.schedule import runtime as runtime_lib
from angel_jax.schedule.simulate import Bandwidths, StageCost

BANDWIDTHS = Bandwidths(h2d=4e9, d2h=4e9, disk_read=1e9, disk_write=1e9, source="pinned (tests/pinned_costs.py)")


def pinned(cost: StageCost) -> StageCost:
    """A stage's times from its bytes: a millisecond a call plus a GB/s of compute over its parameters (a block's
    matmuls grow with its weights), the backward twice the forward, updates at device and host memory speeds."""
    forward = 1e-3 + cost.param_bytes / 1e9
    return dataclasses.replace(cost, forward_s=forward, backward_s=2 * forward,
                               update_device_s=cost.param_bytes / 5e10, update_host_s=cost.param_bytes / 2e9,
                               host_add_s=cost.param_bytes / 4e9)


def pin_costs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans made by the paged runtime from here on use `pinned` stage times and BANDWIDTHS."""
    profile = runtime_lib.profile_costs
    monkeypatch.setattr(runtime_lib, "profile_costs", lambda *a, **k: [pinned(c) for c in profile(*a, **k)])
    monkeypatch.setattr(runtime_lib, "profile_transfers", lambda *a, **k: BANDWIDTHS)
