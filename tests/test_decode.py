"""Key/value-cache decoding (`StagedModel.init_cache` / `decode`) against the whole-sequence forward, for every
family that can sample: a prefill and single-token steps (each attending to the cache) give the logits the
stage-by-stage forward gives over the whole sequence at once. A family that gains `decode` needs one line in
DECODING."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from angel_jax.config import ModelConfig, MoEConfig

# Mixture-of-experts variants: 4 experts top-2 in every other block, with a capacity factor (2 = E / top_k) that
# gives every expert a slot per token, so the whole-sequence forward drops none either (sampling never drops).
_MOE = MoEConfig(experts=4, top_k=2, capacity_factor=2.0, every=2)
DECODING = {
    "gpt": ModelConfig(name="gpt", vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4,
                       compute_dtype="float32"),
    "llama": ModelConfig(name="llama", vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                         compute_dtype="float32"),
    "gpt-moe": ModelConfig(name="gpt", vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4,
                           compute_dtype="float32", moe=_MOE),
    "llama-moe": ModelConfig(name="llama", vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4,
                             n_kv_heads=2, compute_dtype="float32", moe=_MOE),
}
"""a name -> a tiny float32 config of a family that samples."""


def random_params(staged, seed: int):
    """Parameters of the model's shapes drawn at random, far from a fresh initialisation (std 0.02 weights make
    attention nearly uniform, so a wrong position or a wrong cache slot would hardly show): std 0.3 around 0, and
    around 1 for norm scales. Made from the shapes alone: no initialiser to compile."""
    _, abstract = staged.abstract()
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    rng = np.random.default_rng(seed)  # (numpy: jax.random would compile a program per leaf shape)
    return jax.tree_util.tree_unflatten(treedef, [
        jnp.asarray(float(getattr(path[-1], "key", None) == "scale") + 0.3 * rng.standard_normal(leaf.shape),
                    leaf.dtype)
        for path, leaf in leaves])


@pytest.fixture(scope="module", params=sorted(DECODING))
def family(request):
    cfg = DECODING[request.param]
    staged = models.get(cfg)
    return cfg, staged, random_params(staged, 1)


def test_every_decoding_family_is_listed():
    can = sorted(name for name in models.FAMILIES
                 if models.get(ModelConfig(name=name, n_kv_heads=0)).decode is not None)
    assert can == sorted({cfg.name for cfg in DECODING.values()})


@pytest.mark.compares_programs
@pytest.mark.parametrize("prompt_len", [1, 5])
def test_prefill_and_single_token_steps_give_the_whole_sequence_logits(family, prompt_len):
    cfg, staged, params = family
    batch, total = 2, cfg.seq_len  # to the last position the model has
    tokens = jax.random.randint(jax.random.key(2), (batch, total), 0, cfg.vocab_size, jnp.int32)
    out = staged.forward(staged.split(params), tokens)
    whole = np.asarray(getattr(out, "x", out))  # (an MoE decoder's output is a Stream of the logits and its sums)

    step = jax.jit(staged.decode)
    cache = staged.init_cache(batch, cfg.seq_len)
    logits, cache = step(params, cache, tokens[:, :prompt_len], jnp.int32(0))
    got = [np.asarray(logits)]
    for pos in range(prompt_len, total):
        logits, cache = step(params, cache, tokens[:, pos:pos + 1], jnp.int32(pos))
        got.append(np.asarray(logits))
    cached = np.concatenate(got, axis=1)
    assert cached.shape == whole.shape == (batch, total, cfg.vocab_size)
    assert whole.std() > 0.5  # the perturbed model's logits vary: agreement below is not agreement on zeros
    np.testing.assert_allclose(cached, whole, rtol=1e-5, atol=1e-5)
    assert step._cache_size() == (1 if prompt_len == 1 else 2)  # one program per length: pos is traced


def test_the_gpt_refuses_a_cache_past_its_learned_positions():
    cfg = DECODING["gpt"]  # positions 0 .. seq_len-1 have embeddings, no others (rotary families have no limit)
    staged = models.get(cfg)
    assert staged.init_cache(1, cfg.seq_len)["k"].shape == (2, 1, 16, 4, 8)
    with pytest.raises(ValueError, match=f"model.seq_len={cfg.seq_len}"):
        staged.init_cache(1, cfg.seq_len + 1)
