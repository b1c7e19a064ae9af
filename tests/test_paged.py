"""The paged engine against the reference trainer: same losses, budgets that hold, placement that does not change
the arithmetic."""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from angel_jax.config import Config, MemoryConfig, ModelConfig, OptimizerConfig, TrainConfig
from angel_jax.memory import PageLayout
from angel_jax.optim import make_optimizer
from angel_jax.schedule.engine import build_paged_engine
from angel_jax.schedule.plan import PlanError
from angel_jax.train.step import init_state, make_train_step
from models import gpt

MODEL = ModelConfig(d_model=32, n_layers=3, n_heads=2, seq_len=32, compute_dtype="float32")
STEPS = 20


LR = {"adamw": 3e-3, "sgd": 0.05}


def _cfg(optimizer: str = "adamw", **memory) -> Config:
    return Config(model=MODEL, optimizer=OptimizerConfig(name=optimizer, lr=LR[optimizer], warmup_steps=2),
                  train=TrainConfig(steps=STEPS, batch_size=4),
                  memory=MemoryConfig(mode="paged", page_size=16384, **memory))


def _batches(n: int = STEPS) -> list[jax.Array]:
    rng = np.random.default_rng(0)
    # A learnable stream (repeated phrases) so the losses move and errors would compound.
    text = np.frombuffer(b"def f(x):\n    return x + 1\n" * 200, dtype=np.uint8).astype(np.int32)
    starts = rng.integers(0, len(text) - 34, (n, 4))
    return [jnp.asarray(np.stack([text[s:s + 33] for s in row])) for row in starts]


def _reference(cfg: Config, batches: list[jax.Array]) -> tuple[list[float], dict]:
    graphdef, params = gpt.init(cfg.model, 0)
    tx, schedule = make_optimizer(cfg.optimizer, cfg.train.steps)
    step = jax.jit(make_train_step(graphdef, tx, schedule))
    state = init_state(params, tx)
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return losses, state.params


def _paged(cfg: Config, batches: list[jax.Array], on_access=None) -> tuple[list[float], dict, object]:
    _, params = gpt.init(cfg.model, 0)
    engine = build_paged_engine(cfg, params, batches[0])
    engine.executor.on_access = on_access
    losses = [float(engine.executor.step(b)["loss"]) for b in batches]
    out = engine.executor.params()
    disk = engine.store.tiers.get("disk")
    engine.disk_files_before_close = sorted(p for p in __import__("pathlib").Path(disk.root).rglob("c*")) if disk else []
    engine.close()
    return losses, out, engine


def _state_bytes(cfg: Config) -> int:
    return 3 * 4 * gpt.param_count(cfg.model)["total"]  # fp32 params, Adam m and v


def _minimal_budget(cfg: Config, batch: jax.Array) -> int:
    """The device budget that streams every stage: the fixed part plus a one-stage-ahead window."""
    _, params = gpt.init(cfg.model, 0)
    with pytest.raises(PlanError) as e:
        build_paged_engine(Config(**{**cfg.__dict__, "memory": MemoryConfig(mode="paged", page_size=16384,
                                                                               device_budget=1)}), params, batch)
    return int(str(e.value).split("minimum ")[1].split(" B")[0].replace(",", ""))


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_streamed_training_matches_the_reference(optimizer):
    batches = _batches()
    base = _cfg(optimizer)
    budget = _minimal_budget(base, batches[0])
    # What must stay on the device beyond the fixed part is a small fraction of the model state: most streams.
    cfg = _cfg(optimizer, device_budget=budget)
    ref_losses, ref_params = _reference(cfg, batches)
    losses, params, engine = _paged(cfg, batches)
    assert engine.plan.streamed, "the budget should force streaming"
    assert ref_losses[-1] < ref_losses[0] - 0.3, "the toy stream must be learnable"
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(ref_params), jax.tree.leaves(params)):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-3, atol=1e-4)


def test_streamed_and_resident_placements_are_bitwise_identical():
    batches = _batches(8)
    streamed_cfg = _cfg(device_budget=_minimal_budget(_cfg(), batches[0]))
    resident_cfg = _cfg()  # all free memory: everything resident
    l1, p1, e1 = _paged(streamed_cfg, batches)
    l2, p2, e2 = _paged(resident_cfg, batches)
    assert len(e1.plan.streamed) == 5 and not e2.plan.streamed
    assert l1 == l2
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
        np.testing.assert_array_equal(a, b)


def test_optimizer_state_on_disk_matches(tmp_path):
    batches = _batches(6)
    budget = _minimal_budget(_cfg(), batches[0])
    # Host budget: parameters and gradients of the streamed stages, no room for optimizer state -> disk.
    _, params = gpt.init(MODEL, 0)
    staged = gpt.staged(MODEL)
    layout = PageLayout.build(zip([s.name for s in staged.stages], staged.split(params)), 16384)
    biggest_opt = 2 * max(stage.nbytes for stage in layout.stages)  # Adam: m and v
    host = 2 * layout.total_bytes + 2 * biggest_opt + 16384  # + staging of two stages read from disk
    (tmp_path / "pages").mkdir()
    cfg = _cfg(device_budget=budget, host_budget=host, disk_dir=str(tmp_path / "pages"))
    ref_losses, _ = _reference(cfg, batches)
    losses, _, engine = _paged(cfg, batches)
    assert "disk" in engine.plan.opt_home
    assert engine.disk_files_before_close, "the disk tier wrote nothing"
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


def test_device_budget_holds_for_live_arrays():
    batches = _batches(3)
    cfg = _cfg(device_budget=_minimal_budget(_cfg(), batches[0]))
    peak = [0]

    def sample(op, stage):
        jax.effects_barrier()
        live = sum(a.nbytes for a in jax.live_arrays() if a.sharding.memory_kind == "device")
        peak[0] = max(peak[0], live)

    gc.collect()
    baseline = sum(a.nbytes for a in jax.live_arrays() if a.sharding.memory_kind == "device")
    _, _, engine = _paged(cfg, batches, on_access=sample)
    used = peak[0] - baseline
    assert 0 < used <= cfg.memory.device_budget, (used, cfg.memory.device_budget)
