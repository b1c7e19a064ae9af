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


def _losses(model: ModelConfig, data: list[jax.Array], tmp_path, master_weights: bool = False) -> np.ndarray:
    cfg = Config(name="rule", model=model, optimizer=OptimizerConfig(lr=3e-3, warmup_steps=2, schedule="constant",
                                                                     master_weights=master_weights),
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


@pytest.mark.parametrize("family", ["gpt", "llama_tied"])
def test_bfloat16_weights_keep_16_bit_dots_summed_in_float32(family):
    """With model.param_dtype=bfloat16 the layers' dots stay bfloat16 x bfloat16 with float32 results, forward
    and backward (models/cpu_dot.py: XLA:CPU's fast path); none returns bfloat16 (the slow one), and no weight is
    upcast to a float32 dot."""
    model = dataclasses.replace(FAMILIES[family], param_dtype="bfloat16")
    dots = traced_dots(model)
    assert ("bfloat16", "bfloat16", "float32") in dots
    assert ("bfloat16", "bfloat16", "bfloat16") not in dots, sorted(dots)
    assert "matmuls bfloat16 with float32 sums" in precision_line(model)


def test_the_16_bit_product_and_its_gradients_equal_the_float32_ones():
    """cpu_dot.matmul_f32 and its VJP against the float32 dot of the same (upcast) operands, differentiated by
    JAX: the product to float32 rounding (the sums' order differs), the gradients to the one rounding to
    bfloat16 each gets (one unit, 2^-8 relative)."""
    from models import cpu_dot

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k1, (2, 8, 64)).astype(jnp.bfloat16)
    w = jax.random.normal(k2, (64, 32)).astype(jnp.bfloat16)
    c = jax.random.normal(k3, (2, 8, 32))

    def ours(x, w):
        return jnp.sum(cpu_dot.matmul_f32(x, w).astype(jnp.bfloat16).astype(jnp.float32) * c)

    def reference(x, w):
        y = jnp.einsum("btk,kn->btn", x.astype(jnp.float32), w.astype(jnp.float32))
        return jnp.sum(y.astype(jnp.bfloat16).astype(jnp.float32) * c)

    np.testing.assert_allclose(cpu_dot.matmul_f32(x, w), jnp.einsum("btk,kn->btn", x.astype(jnp.float32),
                                                                    w.astype(jnp.float32)), rtol=1e-5, atol=1e-5)
    (gx, gw), (rx, rw) = jax.grad(ours, (0, 1))(x, w), jax.grad(reference, (0, 1))(x, w)
    assert gx.dtype == gw.dtype == jnp.bfloat16
    for got, want in ((gx, rx), (gw, rw)):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2 ** -8,
                                   atol=1e-3)


def test_bfloat16_weights_train_as_with_their_upcast_dots(tmp_path, monkeypatch):
    """8 AdamW steps of a tiny GPT with bfloat16 weights stepped through a float32 master
    (optimizer.master_weights): the 16-bit dots with float32 sums (models/cpu_dot.py) against the same model whose
    weights are upcast to float32 dots (the rule before it), same parameters and batches. The two compute the same
    products and differ in the order of the sums only, so the losses agree to two bfloat16 units (rtol 2^-8)."""
    model = ModelConfig(d_model=64, n_layers=2, n_heads=2, seq_len=32, compute_dtype="bfloat16",
                        param_dtype="bfloat16")
    data = batches(8, model, 4)
    ours = _losses(model, data, tmp_path / "ours", master_weights=True)
    from models import cpu_dot

    monkeypatch.setattr(cpu_dot, "applies", lambda *_: False)
    jax.clear_caches()  # the stage functions are jitted: trace them again under the old rule
    try:
        upcast = _losses(model, data, tmp_path / "upcast", master_weights=True)
    finally:
        jax.clear_caches()
    assert ours[-1] < ours[0] - 0.1, "the losses move"
    assert not np.array_equal(ours, upcast), "two programs that differ in their sums (measured: 4e-4 apart)"
    np.testing.assert_allclose(ours, upcast, rtol=2 ** -8)
