"""The families' matmul rule on the CPU backend (models/common.py `fp32_here`, `dot_general`, `Linear`): a bfloat16
model's matmuls compute in float32 there, forward and backward, in every family; model.cpu_matmul_fp32=false keeps
them in bfloat16; the start-up report says which; and a bfloat16 run's losses equal the float32 run's within
bfloat16 rounding."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from angel_jax.config import Config, ModelConfig, MoEConfig, OptimizerConfig, TrainConfig
from angel_jax.train.engines import InMemoryEngine
from angel_jax.train.step import make_loss_fn
import models
from models.common import precision_line
from test_paged import batches

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the rule is the CPU backend's")

TINY = dict(d_model=32, n_layers=2, n_heads=2, seq_len=16, compute_dtype="bfloat16")
FAMILIES = {
    "gpt": ModelConfig(**TINY),
    "llama_tied": ModelConfig(name="llama", tie_embeddings=True, n_kv_heads=1, **TINY),
    "t5": ModelConfig(name="t5", **TINY),
    "gpt_moe": ModelConfig(moe=MoEConfig(experts=4, top_k=2, every=2), **TINY),
    "llama_moe": ModelConfig(name="llama", moe=MoEConfig(experts=4, top_k=2, every=1), **TINY),
}


def dot_dtypes(jaxpr) -> set[tuple[str, str, str]]:
    """(lhs, rhs, out) dtypes of every dot_general in a jaxpr, its sub-jaxprs (scans, remat, custom rules,
    nested jits) included."""
    found = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            lhs, rhs = (str(v.aval.dtype) for v in eqn.invars)
            found.add((lhs, rhs, str(eqn.outvars[0].aval.dtype)))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found |= dot_dtypes(inner)
    return found


def traced_dots(model: ModelConfig) -> set[tuple[str, str, str]]:
    """The dots of one training step's loss and gradient of `model`, as traced for this backend."""
    staged = models.get(model)
    graphdef, params = staged.init(0)
    loss = make_loss_fn(graphdef, staged.loss)
    rows = jnp.zeros((2, model.seq_len + 1), jnp.int32)
    return dot_dtypes(jax.make_jaxpr(jax.value_and_grad(loss))(params, rows).jaxpr)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_bfloat16_model_multiplies_in_float32_on_the_cpu(family):
    """Every matmul of the forward and the backward (the layers, attention, a tied head, MoE experts) has float32
    operands; before the rule the layers' dots were bfloat16 x bfloat16, the ones XLA:CPU runs ~12x slower."""
    dots = traced_dots(FAMILIES[family])
    assert dots, "no dot traced"
    narrow = {d for d in dots if "bfloat16" in d}
    assert not narrow, f"{family}: bfloat16 dots on the CPU backend: {sorted(narrow)}"


def test_the_key_turns_the_rule_off():
    off = traced_dots(dataclasses.replace(FAMILIES["gpt"], cpu_matmul_fp32=False))
    assert ("bfloat16", "bfloat16", "bfloat16") in off
    assert not any("bfloat16" in d for d in traced_dots(dataclasses.replace(FAMILIES["gpt"])))


def test_the_report_states_the_rule():
    assert precision_line(FAMILIES["gpt"]) == (
        "compute bfloat16, parameters float32, matmuls in float32 on cpu: XLA:CPU has no fast bfloat16 dot "
        "(model.cpu_matmul_fp32=false keeps them in bfloat16)")
    assert "matmuls in bfloat16" in precision_line(dataclasses.replace(FAMILIES["gpt"], cpu_matmul_fp32=False))
    assert precision_line(ModelConfig(compute_dtype="float32")) == "compute float32, parameters float32"


def _losses(model: ModelConfig, data: list[jax.Array], tmp_path) -> np.ndarray:
    cfg = Config(name="rule", model=model, optimizer=OptimizerConfig(lr=3e-3, warmup_steps=2, schedule="constant"),
                 train=TrainConfig(steps=len(data), batch_size=4, run_dir=str(tmp_path / model.compute_dtype)))
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1], axis_types=(jax.sharding.AxisType.Auto,))
    engine = InMemoryEngine(cfg, mesh)
    return np.array([float(engine.step(jax.device_put(rows, engine.batch_sharding))["loss"]) for rows in data])


def test_bfloat16_losses_equal_float32_within_bfloat16_rounding(tmp_path):
    """8 AdamW steps of a tiny GPT, bfloat16 compute (the rule on) against float32 compute, from the same
    parameters and batches. With the rule the only roundings left are of the activations to bfloat16 (relative
    2^-9 each); the loss, a mean over tokens, and the few steps' parameters carry errors of that order, so the
    losses must agree to two bfloat16 units, rtol 2^-8 (measured: within 8e-4)."""
    fp32 = ModelConfig(d_model=64, n_layers=2, n_heads=2, seq_len=32, compute_dtype="float32")
    data = batches(8, fp32, 4)
    reference = _losses(fp32, data, tmp_path)
    bf16 = _losses(dataclasses.replace(fp32, compute_dtype="bfloat16"), data, tmp_path)
    assert reference[-1] < reference[0] - 0.1, "the losses move"
    np.testing.assert_allclose(bf16, reference, rtol=2 ** -8)
