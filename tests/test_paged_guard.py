"""The anomaly guard on the paged engine: updates dropped for the loss, the gradient norm or the (global) update
norm, and the learning-rate multiplier, exactly as the reference trainer does them, on every tier."""

from __future__ import annotations

import math

import jax
import numpy as np

from angel_jax.optim import make_optimizer
from angel_jax.train.paged import PagedTrainEngine
from angel_jax.train.step import StepControls, init_state, make_train_step
from models import gpt
from test_paged import batches
from test_paged_state import MODEL, _mesh, _mixed

CONTROLS = [
    None,
    StepControls(max_grad_norm=1e-6),  # dropped for the gradient norm (decided before any update)
    StepControls(max_update_norm=1e-9),  # dropped for the update norm (a first pass over every stage)
    StepControls(max_update_norm=1e3),  # the same first pass, and applied
    StepControls(lr_scale=0.5),
    StepControls(max_loss=1.0),  # dropped for the loss
    None,
]


def test_guard_and_lr_scale_match_the_reference(tmp_path):
    cfg = _mixed(tmp_path)
    data = batches(len(CONTROLS), MODEL, 2)
    graphdef, params = gpt.init(MODEL, cfg.train.seed)
    tx, schedule = make_optimizer(cfg.optimizer, cfg.train.steps)
    ref_step = jax.jit(make_train_step(graphdef, tx, schedule, gpt.cross_entropy))
    state = init_state(params, tx)
    ref = []
    for b, c in zip(data, CONTROLS):
        state, m = ref_step(state, b, (c or StepControls()).as_arrays())
        ref.append({k: float(v) for k, v in m.items()})

    engine = PagedTrainEngine(cfg, _mesh())
    try:
        plan = engine.built.plan
        assert plan.resident and "disk" in plan.opt_home, plan  # device, host and disk updates all guarded
        got = [{k: float(v) for k, v in engine.step(jax.device_put(b, engine.batch_sharding), c).items()}
               for b, c in zip(data, CONTROLS)]
        arrays = engine.state_snapshot().arrays
        final = engine.params()
    finally:
        engine.close()
    assert [m["skipped"] for m in got] == [m["skipped"] for m in ref] == [0, 1, 1, 0, 0, 1, 0]
    for key in ("loss", "grad_norm", "update_norm", "lr"):
        np.testing.assert_allclose([m[key] for m in got], [m[key] for m in ref], rtol=2e-5, err_msg=key)
    assert int(arrays["applied"]) == int(state.step) == 4 and int(arrays["step"]) == len(CONTROLS)
    # Dropped updates left every tier's pages as they were: an update wrongly applied or dropped would move nearly
    # every element by ~lr. Elements whose gradient is within rounding of zero (the key biases: softmax ignores a
    # shift of the keys) may differ by Adam's normalised step (see test_paged): about 1% of a bias leaf.
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(final)):
        assert np.mean(~np.isclose(np.asarray(a), b, rtol=1e-4, atol=1e-6)) < 0.02
    assert all(math.isfinite(m["update_norm"]) for m in got)
