"""The process's real host peak against the plan's (angel_jax/memory/host_peak.py): measured from the kernel's peak
RSS (reset before the engine is built), compared after the first steady step, one warning line when it is over."""

from __future__ import annotations

import logging
import mmap

import jax
import numpy as np
import pytest

from angel_jax.config import Config, MemoryConfig, ModelConfig, OptimizerConfig, TrainConfig
from angel_jax.memory import host_peak
from angel_jax.memory.host_peak import HostPeakCheck

MIB = 1 << 20


def _peak_resettable() -> bool:
    return host_peak.reset_peak() is not None


pytestmark = pytest.mark.skipif(not _peak_resettable(), reason="needs Linux's /proc/self/clear_refs")


def _resident(nbytes: int) -> mmap.mmap:
    """`nbytes` of fresh anonymous memory, every page written: resident whatever the allocator holds free already
    (a numpy array could reuse pages an earlier test freed, and not grow the peak)."""
    m = mmap.mmap(-1, nbytes)
    np.frombuffer(m, np.uint8)[::4096] = 1
    return m


def test_a_growth_past_the_plan_is_one_warning_and_within_it_none():
    over = HostPeakCheck.start(planned=0)
    held = _resident(host_peak.FIXED_OVERHEAD + 256 * MIB)
    warning = over.check()
    # (the kernel's RSS counters are per-thread and synced in batches, and memory freed since the reset counts
    # against the growth: a few MiB either way)
    assert warning is not None and over.measured >= len(held) - 32 * MIB
    assert "the plan's 0 B" in warning and "\n" not in warning
    held.close()
    within = HostPeakCheck.start(planned=600 * MIB)
    held = _resident(500 * MIB)
    assert within.check() is None and 500 * MIB - 32 * MIB <= within.measured <= within.allowed
    held.close()


def test_a_paged_engine_under_budgets_stays_within_its_plan(tmp_path, caplog):
    """A GPT paged over device (host RAM here), host and disk budgets, three steps: its process's peak grows by no
    more than the plan's device and host bytes + 10% + the fixed overhead, and nothing is logged."""
    from angel_jax.train.paged import PagedTrainEngine

    model = ModelConfig(d_model=256, n_layers=8, n_heads=4, seq_len=32, vocab_size=256)
    (tmp_path / "disk").mkdir()
    cfg = Config(model=model, optimizer=OptimizerConfig(name="adamw", lr=1e-3),
                 train=TrainConfig(steps=3, batch_size=2, run_dir=str(tmp_path / "run")),
                 memory=MemoryConfig(mode="paged", page_size=1 << 20, device_budget=20_000_000,
                                     host_budget=40_000_000, disk_dir=str(tmp_path / "disk")))
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1], axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(0)
    with caplog.at_level(logging.WARNING, logger="angel_jax.train.paged"):
        engine = PagedTrainEngine(cfg, mesh)
        try:
            plan = engine.built.plan
            assert plan.streamed and "disk" in plan.opt_home, plan
            assert engine.host_peak.planned == plan.peak_bytes["device"] + plan.peak_bytes["host"]  # the CPU: one RAM
            for _ in range(3):
                float(engine.step(jax.device_put(rng.integers(0, 256, (2, 33)).astype(np.int32),
                                                 engine.batch_sharding))["loss"])
        finally:
            engine.close()
    check = engine.host_peak
    # (the growth may be less than the plan: pages can reuse memory the process freed before)
    assert check.measured is not None and check.measured <= check.allowed, (check, plan.peak_bytes)
    assert "host memory:" not in caplog.text


def test_the_check_covers_evaluations(tmp_path, caplog):
    """The check after the first steady steps is within the plan; host memory that grows during a later evaluation
    (here: memory past the plan held while it runs) is still caught, after that evaluation, in one warning line.
    Before, the check ran once, and an end-of-run evaluation that grew past the plan went unreported."""
    from angel_jax.train.paged import HOST_PEAK_AFTER, PagedTrainEngine

    model = ModelConfig(d_model=64, n_layers=2, n_heads=2, seq_len=32, vocab_size=256, compute_dtype="float32")
    cfg = Config(model=model, optimizer=OptimizerConfig(name="adamw", lr=1e-3),
                 train=TrainConfig(steps=4, batch_size=2, run_dir=str(tmp_path / "run")),
                 memory=MemoryConfig(mode="paged", page_size=1 << 16, device_budget=2_000_000))
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1], axis_types=(jax.sharding.AxisType.Auto,))
    rows = lambda: jax.device_put(np.random.default_rng(0).integers(0, 256, (2, 33)).astype(np.int32),
                                  engine.batch_sharding)
    with caplog.at_level(logging.WARNING, logger="angel_jax.train.paged"):
        engine = PagedTrainEngine(cfg, mesh)
        try:
            for _ in range(HOST_PEAK_AFTER + 2):
                float(engine.step(rows())["loss"])
            assert engine.host_peak.measured is not None and "host memory:" not in caplog.text
            held = _resident(engine.host_peak.allowed + 64 * MIB)
            float(engine.eval_loss(rows()))
            held.close()
        finally:
            engine.close()
    warnings = [r.getMessage() for r in caplog.records if "host memory:" in r.getMessage()]
    assert len(warnings) == 1 and "(measured after an evaluation)" in warnings[0], warnings
