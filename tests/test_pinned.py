"""Pinned host memory on a GPU (angel_jax/memory/pinned.py): the pool's growth rule reproduces the 49 GiB request
that killed a 9.7 B GPT on one H200, and the limit the engine sets from its plan bounds the pool to the plan.
Pure arithmetic and a plan from shapes: no GPU needed (nvidia-smi's answer is given)."""

from __future__ import annotations

import collections
import os
from pathlib import Path

import pytest

from angel_jax.config import load_config
from angel_jax.memory import pinned
from angel_jax.schedule import budgets as budgets_lib
from angel_jax.schedule.blueprint import blueprint
from angel_jax.schedule.pinned_limit import configure_pinned_limit

GIB, MIB = 1 << 30, 1 << 20
ROOT = Path(__file__).resolve().parents[1]


def test_the_pools_growth_reproduces_the_h200_request():
    """256 MiB pages allocated one by one under a 113 GiB limit (90% of that machine's RAM): regions of 1, 1, 2,
    ... 128 pages (64 GiB), then, for page 257, the rest of the limit in one piece: 52,613,349,376 B."""
    regions = pinned.pool_regions(113 * GIB, [256 * MIB] * 300)
    assert regions[:9] == [256 * MIB * k for k in (1, 1, 2, 4, 8, 16, 32, 64, 128)]
    assert sum(regions[:9]) == 64 * GIB
    assert regions[9] == 52_613_349_376 == 49 * GIB


def test_a_limit_from_the_plan_bounds_the_pool_to_the_plan():
    need = 86 * GIB  # the 9.7 B plan's host tier: 23 streamed stages x 15 pages of 256 MiB, about
    limit = pinned.limit_for(need)
    assert limit == 96  # 86 x 1.1 + 1, rounded up
    regions = pinned.pool_regions(limit * GIB, [256 * MIB] * (need // (256 * MIB)))
    assert sum(regions) >= need and sum(regions) <= limit * GIB


def test_the_limit_is_read_as_whole_gib_with_xlas_default():
    assert pinned.limit_bytes({}) == 64 * GIB
    assert pinned.limit_bytes({pinned.LIMIT_ENV: "96"}) == 96 * GIB


@pytest.fixture
def h200(monkeypatch):
    """A machine with one 141 GB GPU (jax's 75% of it) and 125 GiB of RAM, 120 available."""
    monkeypatch.setenv(pinned.LIMIT_ENV, "0")  # (recorded as unset: what configure_pinned_limit sets is undone)
    monkeypatch.delenv(pinned.LIMIT_ENV)
    monkeypatch.setattr(pinned, "gpu_memory_bytes", lambda: int(141e9 * 0.75))
    vm = collections.namedtuple("vm", "total available")
    monkeypatch.setattr(budgets_lib.psutil, "virtual_memory", lambda: vm(125 * GIB, 120 * GIB))


def _cfg(*overrides: str):
    return load_config(ROOT / "experiments" / "gpt_tiny.yaml",
                       ["model.d_model=4096", "model.n_heads=32", "model.n_layers=48", "model.seq_len=2048",
                        "model.compute_dtype=bfloat16", "train.batch_size=1", "memory.page_size=268435456",
                        "memory.page_fit=false",  # (the figures below: its blocks on 256 MiB pages)
                        *overrides])


def test_before_the_gpu_client_starts_the_limit_is_set_to_the_plans_host_tier(h200, monkeypatch):
    cfg = _cfg("memory.mode=paged")
    line = configure_pinned_limit(cfg)
    need = budgets_lib.pinned_host_need(cfg, blueprint(cfg).sizes, int(141e9 * 0.75))
    assert need is not None and need > 64 * GIB  # more than XLA's default would give
    gib = int(os.environ[pinned.LIMIT_ENV])
    assert gib == pinned.limit_for(need) and gib * GIB < 120 * GIB - 12.5 * GIB  # under the host budget
    assert line is not None and f"limited to {gib} GiB" in line and pinned.LIMIT_ENV in line


def test_the_limit_is_left_alone_when_set_in_memory_or_without_a_gpu(h200, monkeypatch):
    monkeypatch.setenv(pinned.LIMIT_ENV, "50")
    assert configure_pinned_limit(_cfg("memory.mode=paged")) is None
    monkeypatch.delenv(pinned.LIMIT_ENV)
    assert configure_pinned_limit(_cfg("memory.mode=in_memory")) is None
    monkeypatch.setattr(pinned, "gpu_memory_bytes", lambda: None)
    assert configure_pinned_limit(_cfg("memory.mode=paged")) is None
    assert pinned.LIMIT_ENV not in os.environ


def test_on_the_cpu_nvidia_smi_is_not_asked(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert pinned.gpu_memory_bytes() is None
