"""The in-memory engine's two-phase step (train/step.py `make_step_phases`): the reference step's arithmetic, the
guard's drops leave the state bit for bit, and no phase holds a second copy of the training state."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from angel_jax.config import Config, ModelConfig, OptimizerConfig, TrainConfig
from angel_jax.optim import make_optimizer
from angel_jax.train.engines import InMemoryEngine
from angel_jax.train.protocol import named_leaves
from angel_jax.train.step import StepControls, make_train_step
from models import gpt
from test_paged import batches

# Wide next to its tokens: parameters dominate the step's memory, as in the models the split is for.
MODEL = ModelConfig(d_model=128, n_layers=2, n_heads=2, seq_len=16, compute_dtype="float32")
CFG = Config(model=MODEL, optimizer=OptimizerConfig(name="adamw", lr=1e-3, warmup_steps=2, grad_clip=0.5),
             train=TrainConfig(steps=8, batch_size=2))
CONTROLS = [
    None,
    StepControls(max_update_norm=1e3),  # judged on the update norm, applied
    StepControls(max_update_norm=1e-9),  # dropped for the update norm
    StepControls(lr_scale=0.5),
    StepControls(max_loss=1.0),  # dropped for the loss
    StepControls(max_grad_norm=1e-6),  # dropped for the gradient norm
    None,
]


def _mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def _state(engine: InMemoryEngine) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in named_leaves(engine.state).items()}


@pytest.mark.compares_programs
def test_two_phases_match_the_one_function_step():
    data = batches(len(CONTROLS), MODEL, 2)
    engine = InMemoryEngine(CFG, _mesh())
    graphdef, _ = gpt.abstract_params(MODEL)
    tx, schedule = make_optimizer(CFG.optimizer, CFG.train.steps)
    one_step = jax.jit(make_train_step(graphdef, tx, schedule, gpt.cross_entropy))
    state = jax.tree.map(jnp.array, engine.state)  # the same initial state, as a copy the engine cannot donate
    ref, got = [], []
    for b, c in zip(data, CONTROLS):
        state, m = one_step(state, b, (c or StepControls()).as_arrays())
        ref.append({k: float(v) for k, v in m.items()})
        got.append({k: float(v) for k, v in engine.step(jax.device_put(b, engine.batch_sharding), c).items()})
    assert [m["skipped"] for m in got] == [m["skipped"] for m in ref] == [0, 0, 1, 0, 1, 1, 0]
    assert got[0] == ref[0]  # the first step computes the same numbers in both
    # Later steps: XLA fuses the in-place update differently (multiply-adds contracted elsewhere), so the state
    # differs in the last bits; an update applied twice, skipped or computed from other gradients would not.
    for key in ("loss", "grad_norm", "update_norm", "lr"):
        np.testing.assert_allclose([m[key] for m in got], [m[key] for m in ref], rtol=1e-5, err_msg=key)
    # Elements whose gradient is within rounding of zero (the key biases: softmax ignores a shift of the keys) may
    # differ by Adam's normalised step (see test_paged_guard): a small share of a bias leaf.
    mine = _state(engine)
    for name, value in named_leaves(state).items():
        assert np.mean(~np.isclose(mine[name], np.asarray(value), rtol=1e-4, atol=1e-6)) < 0.02, name
    assert int(mine["step"]) == 4


def test_a_dropped_update_leaves_the_state_bit_for_bit():
    data = batches(3, MODEL, 2)
    engine = InMemoryEngine(CFG, _mesh())
    engine.step(jax.device_put(data[0], engine.batch_sharding))
    before = _state(engine)
    for b, c in zip(data[1:], (StepControls(max_update_norm=1e-9), StepControls(max_loss=1.0))):
        assert float(engine.step(jax.device_put(b, engine.batch_sharding), c)["skipped"]) == 1.0
    after = _state(engine)
    assert after.keys() == before.keys()
    assert all(after[k].dtype == before[k].dtype and np.array_equal(after[k], before[k]) for k in before)


def test_no_phase_holds_a_second_copy_of_the_state():
    """`apply` writes the new state over the donated one (XLA aliases every byte of it and needs no temporaries);
    `judge` writes nothing of the state: its only large output is the clipped gradients."""
    engine = InMemoryEngine(CFG, _mesh())
    param_bytes = sum(a.nbytes for a in jax.tree.leaves(engine.state.params))
    state_bytes = sum(a.nbytes for a in jax.tree.leaves(engine.state))
    batch = jax.ShapeDtypeStruct((CFG.train.batch_size, MODEL.seq_len + 1), jnp.int32)
    controls = StepControls().as_numpy()
    judge = engine._judge.lower(engine.state, batch, controls).compile().memory_analysis()
    ok = jax.ShapeDtypeStruct((), jnp.bool_)
    apply = engine._apply.lower(engine.state, engine.state.params, ok, controls).compile().memory_analysis()
    assert apply.alias_size_in_bytes == state_bytes
    assert apply.temp_size_in_bytes <= 0.05 * param_bytes, apply
    assert judge.output_size_in_bytes <= param_bytes + 1024, judge  # the gradients and a few scalars
