"""models/llama.py: the Llama family against independent computations of the same function: a numpy forward
written from Hugging Face's LlamaForCausalLM (rotate_half RoPE, repeat_kv grouping, RMSNorm, SwiGLU), the stage
view, stage-by-stage initialisation, key/value-cache decoding, and the paged engine training it as the reference
trainer does."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from angel_jax.config import Config, ConfigError, MemoryConfig, ModelConfig, MoEConfig, TrainConfig, load_config
from angel_jax.schedule.blueprint import blueprint
from angel_jax.schedule.budgets import fixed_device_bytes
from angel_jax.train.engines import build_engine
from angel_jax.cli.plan import estimate_costs
from models import llama
from test_paged import _cfg, assert_mostly_streamed, batches, eighth, paged, reference

ROOT = Path(__file__).resolve().parent.parent
# Grouped-query attention (2 query heads per key/value head), head_dim 8, an MLP width that is no multiple of d.
CFG = ModelConfig(name="llama", vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                  mlp_hidden=48, rope_theta=500.0, norm_eps=1e-5, compute_dtype="float32")
B = 2
# Llama 3.1's RoPE scaling with an original context of 32: of the wavelengths 6.3, 29.7, 140 and 664 (head
# dimension 8, rope_theta 500) the first is kept (under 32 / 4), the second interpolated, the others stretched.
LLAMA3 = dict(rope_scaling="llama3", rope_factor=4.0, rope_original_max_positions=32)
# Every variant of the layout at once: that scaling, q/k/v and o biases, a tied head.
VARIANT = dataclasses.replace(CFG, **LLAMA3, qkv_bias=True, o_bias=True, tie_embeddings=True)


def _tokens(t: int = CFG.seq_len, seed: int = 1) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (B, t), 0, CFG.vocab_size, dtype=jnp.int32)


def _forward(cfg: ModelConfig):
    graphdef, _ = llama.abstract_params(cfg)
    return jax.jit(lambda params, tokens: nnx.merge(graphdef, params)(tokens))


def _random_params(cfg: ModelConfig, seed: int = 0) -> dict:
    """Every leaf drawn afresh (norm scales around 1, not the initial ones), so that a scale applied wrongly, or a
    matrix used transposed, shows."""
    abstract = llama.abstract_params(cfg)[1]
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    rng = np.random.default_rng(seed)
    out = []
    for path, leaf in leaves:
        if path[-1].key == "scale":
            out.append(1 + 0.3 * rng.standard_normal(leaf.shape))
        else:
            out.append(rng.standard_normal(leaf.shape) / np.sqrt(leaf.shape[-2] if len(leaf.shape) > 1 else 1))
    return jax.tree.unflatten(treedef, [jnp.asarray(x, jnp.float32) for x in out])


# ------------------------------------------------------------------------- a numpy Hugging Face-style reference


def _llama3_inv_freq(inv_freq: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """modeling_rope_utils.py's `_compute_llama3_parameters`, in float64 numpy, one frequency at a time."""
    low_wavelen = cfg.rope_original_max_positions / cfg.rope_low_freq_factor
    high_wavelen = cfg.rope_original_max_positions / cfg.rope_high_freq_factor
    out = []
    for f in inv_freq:
        wavelen = 2 * np.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / cfg.rope_factor)
        else:
            smooth = ((cfg.rope_original_max_positions / wavelen - cfg.rope_low_freq_factor)
                      / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor))
            out.append((1 - smooth) * f / cfg.rope_factor + smooth * f)
    return np.array(out)


def _hf_reference_logits(params: dict, cfg: ModelConfig, tokens: np.ndarray) -> np.ndarray:
    """The forward of transformers' LlamaForCausalLM in float64 numpy, step by step as modeling_llama.py writes it
    (each nn.Linear weight being our kernel transposed: y = x @ W.T + bias = x @ kernel + bias; a tied lm_head
    being the embedding: y = x @ E.T)."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    H, K, D, L = cfg.n_heads, cfg.kv_heads, cfg.d_model // cfg.n_heads, cfg.n_layers
    b, t = tokens.shape

    def rms_norm(x, weight):  # LlamaRMSNorm
        return weight * (x / np.sqrt((x ** 2).mean(-1, keepdims=True) + cfg.norm_eps))

    def rotate_half(x):
        x1, x2 = x[..., : D // 2], x[..., D // 2:]
        return np.concatenate([-x2, x1], axis=-1)

    def linear(x, w):  # nn.Linear, with its bias when it has one
        return x @ w["kernel"] + w["bias"] if "bias" in w else x @ w["kernel"]

    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, D, 2) / D))  # LlamaRotaryEmbedding
    if cfg.rope_scaling == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, cfg)
    freqs = np.outer(np.arange(t), inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb), np.sin(emb)  # [T, D], broadcast over [B, heads, T, D]

    x = p["embed"]["tokens"]["embedding"][tokens]
    causal = np.triu(np.full((t, t), -np.inf), k=1)
    for layer in range(L):
        w = jax.tree.map(lambda a: a[layer], p["blocks"])
        h = rms_norm(x, w["attn_norm"]["scale"])
        q = linear(h, w["q"]).reshape(b, t, H, D).transpose(0, 2, 1, 3)
        k = linear(h, w["k"]).reshape(b, t, K, D).transpose(0, 2, 1, 3)
        v = linear(h, w["v"]).reshape(b, t, K, D).transpose(0, 2, 1, 3)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin  # apply_rotary_pos_emb
        k, v = np.repeat(k, H // K, axis=1), np.repeat(v, H // K, axis=1)  # repeat_kv: head h reads kv head h // G
        scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(D) + causal
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = (probs @ v).transpose(0, 2, 1, 3).reshape(b, t, H * D)
        x = x + linear(attn, w["o"])
        h = rms_norm(x, w["mlp_norm"]["scale"])
        gate = h @ w["gate"]["kernel"]
        x = x + (gate / (1 + np.exp(-gate)) * (h @ w["up"]["kernel"])) @ w["down"]["kernel"]
    unembed = p["head"]["unembed"]["kernel"] if "unembed" in p["head"] else p["embed"]["tokens"]["embedding"].T
    return rms_norm(x, p["head"]["norm"]["scale"]) @ unembed


@pytest.mark.compares_programs
@pytest.mark.parametrize("kv_heads", [2, 4, 1], ids=["gqa", "mha", "mqa"])
def test_logits_equal_the_hugging_face_formulation(kv_heads):
    _assert_hf_logits(dataclasses.replace(CFG, n_kv_heads=kv_heads))


@pytest.mark.compares_programs
@pytest.mark.parametrize("cfg", [dataclasses.replace(CFG, **LLAMA3), dataclasses.replace(CFG, qkv_bias=True),
                                 dataclasses.replace(CFG, qkv_bias=True, o_bias=True),
                                 dataclasses.replace(CFG, tie_embeddings=True), VARIANT],
                         ids=["llama3", "qwen2", "attention_bias", "tied", "all"])
def test_variants_equal_the_hugging_face_formulation(cfg):
    _assert_hf_logits(cfg)


def _assert_hf_logits(cfg: ModelConfig) -> None:
    params = _random_params(cfg)
    tokens = _tokens()
    got = np.asarray(_forward(cfg)(params, tokens))
    want = _hf_reference_logits(params, cfg, np.asarray(tokens))
    assert got.dtype == np.float32 and got.shape == (B, CFG.seq_len, CFG.vocab_size)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_leaves_have_the_hugging_face_shapes():
    """The names and (transposed) shapes another family's weights map onto, one module for one module."""
    shapes = jax.tree.map(lambda a: a.shape, llama.abstract_params(CFG)[1])
    L, d, V, h, D = CFG.n_layers, CFG.d_model, CFG.vocab_size, CFG.hidden, CFG.d_model // CFG.n_heads
    assert shapes == {
        "embed": {"tokens": {"embedding": (V, d)}},
        "blocks": {"attn_norm": {"scale": (L, d)}, "q": {"kernel": (L, d, CFG.n_heads * D)},
                   "k": {"kernel": (L, d, CFG.kv_heads * D)}, "v": {"kernel": (L, d, CFG.kv_heads * D)},
                   "o": {"kernel": (L, CFG.n_heads * D, d)}, "mlp_norm": {"scale": (L, d)},
                   "gate": {"kernel": (L, d, h)}, "up": {"kernel": (L, d, h)}, "down": {"kernel": (L, h, d)}},
        "head": {"norm": {"scale": (d,)}, "unembed": {"kernel": (d, V)}},
    }


# ------------------------------------------------------------------------------------------------------ RoPE


def test_rope_rotates_dimension_j_with_j_plus_half():
    """Hugging Face's layout: the pairs are (j, j + D/2), not Meta's interleaved (2j, 2j + 1)."""
    D, pos = 8, 3
    cos, sin = llama.rope_angles(jnp.array([pos]), D, 10000.0)
    for j in range(D // 2):
        unit = jnp.zeros((1, 1, 1, D)).at[..., j].set(1.0)
        out = np.asarray(llama.apply_rope(unit, cos, sin))[0, 0, 0]
        angle = pos * 10000.0 ** (-2 * j / D)
        want = np.zeros(D)
        want[j], want[j + D // 2] = np.cos(angle), np.sin(angle)
        np.testing.assert_allclose(out, want, atol=1e-6)


def test_rope_scores_depend_only_on_the_relative_position():
    D = 16
    q, k = jax.random.normal(jax.random.key(0), (2, 1, 1, 1, D))

    def score(m: int, n: int) -> float:
        cos, sin = llama.rope_angles(jnp.array([m, n]), D, 10000.0)
        rq = llama.apply_rope(q, cos[:1], sin[:1])
        rk = llama.apply_rope(k, cos[1:], sin[1:])
        return float((rq * rk).sum())

    base = score(5, 2)
    for shift in (1, 7, 40):
        assert score(5 + shift, 2 + shift) == pytest.approx(base, rel=1e-4, abs=1e-5)
    assert abs(score(5, 3) - base) > 1e-3  # another distance gives another score
    assert score(0, 0) == pytest.approx(float((q * k).sum()), rel=1e-6)  # position 0 is the identity


# --------------------------------------------------------------------------------------- stages and counts


@pytest.mark.compares_programs
def test_gqa_equals_multi_head_attention_with_repeated_key_value_heads():
    """kv_heads < n_heads through dot_product_attention's grouping vs the same model with every key/value head
    copied for the query heads it serves (the multi-head model computes attention another way)."""
    params = _random_params(CFG)
    mha = dataclasses.replace(CFG, n_kv_heads=CFG.n_heads)
    group, D = CFG.n_heads // CFG.kv_heads, CFG.d_model // CFG.n_heads

    def repeat(kernel):  # [L, d, K * D] -> [L, d, H * D], kv head k serving query heads k*G .. k*G + G - 1
        L, d, _ = kernel.shape
        return jnp.repeat(kernel.reshape(L, d, CFG.kv_heads, D), group, axis=2).reshape(L, d, CFG.n_heads * D)

    widened = {**params, "blocks": {**params["blocks"], "k": {"kernel": repeat(params["blocks"]["k"]["kernel"])},
                                    "v": {"kernel": repeat(params["blocks"]["v"]["kernel"])}}}
    tokens = _tokens()
    np.testing.assert_allclose(np.asarray(_forward(CFG)(params, tokens)),
                               np.asarray(_forward(mha)(widened, tokens)), rtol=1e-5, atol=1e-5)


@pytest.mark.compares_programs
@pytest.mark.parametrize("cfg", [CFG, dataclasses.replace(VARIANT, tie_embeddings=False)], ids=["plain", "variant"])
def test_staged_forward_equals_whole_model(cfg):
    """Stage by stage (one jitted program per kind, blocks one at a time) vs the whole model with scanned blocks."""
    staged = models.get(cfg)
    assert [s.name for s in staged.stages] == ["embed", "block.0", "block.1", "head"]
    params = _random_params(cfg)
    tokens = _tokens()
    whole = np.asarray(_forward(cfg)(params, tokens))
    apply = {kind: jax.jit(fn) for kind, fn in staged.apply.items()}
    x = tokens
    for stage, p in zip(staged.stages, staged.split(params)):
        x = apply[stage.kind](p, x)
    np.testing.assert_allclose(np.asarray(x), whole, rtol=1e-5, atol=1e-5)
    merged = staged.merge(staged.split(params))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(params)))


@pytest.mark.compares_programs
@pytest.mark.parametrize("variant", [dict(scan_blocks=False), dict(remat=True)], ids=["unrolled", "remat"])
def test_block_execution_variants_give_the_same_logits(variant):
    params = _random_params(CFG)
    tokens = _tokens()
    np.testing.assert_allclose(np.asarray(_forward(dataclasses.replace(CFG, **variant))(params, tokens)),
                               np.asarray(_forward(CFG)(params, tokens)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cfg", [CFG, dataclasses.replace(CFG, compute_dtype="bfloat16", param_dtype="bfloat16"),
                                 VARIANT], ids=["float32", "bfloat16", "variant"])
def test_every_stage_initialised_alone_equals_the_whole_model_split_bit_for_bit(cfg):
    staged = models.get(cfg)
    for seed in (0, 7):
        whole = staged.split(staged.init(seed)[1])
        for i, stage in enumerate(staged.stages):
            alone = staged.init_stage(seed, i)
            assert jax.tree.structure(alone) == jax.tree.structure(whole[i]), stage.name
            for a, w in zip(jax.tree.leaves(alone), jax.tree.leaves(whole[i])):
                assert a.dtype == w.dtype == jnp.dtype(cfg.param_dtype) and np.array_equal(a, w), stage.name
    blocks = [staged.init_stage(0, 1 + j)["q"]["kernel"] for j in range(cfg.n_layers)]
    assert not np.array_equal(blocks[0], blocks[1])  # each block draws from its own key


def _counts(params) -> dict[str, int]:
    leaves = jax.tree_util.tree_leaves_with_path(params)
    total = sum(int(np.prod(leaf.shape)) for _, leaf in leaves)
    matmul = sum(int(np.prod(leaf.shape)) for path, leaf in leaves if path[-1].key == "kernel")
    return {"total": total, "matmul": matmul, "active": matmul}  # dense: a token uses every weight


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_param_count_and_flops_match_the_real_leaves(kv_heads):
    cfg = dataclasses.replace(CFG, n_kv_heads=kv_heads)
    counts = _counts(llama.abstract_params(cfg)[1])  # the constructor's shapes, nothing allocated
    assert llama.param_count(cfg) == counts
    assert llama.flops_per_token(cfg) == 6 * counts["matmul"] + 12 * cfg.n_layers * cfg.d_model * cfg.seq_len


def test_param_count_of_biases_and_a_tied_head():
    """Biases count in the total, not as matmul weights; a tied head has no matrix of its own, but the embedding's
    enters its product: counted once in the total, and in the matmul weights as the unembedding."""
    counts = _counts(llama.abstract_params(VARIANT)[1])
    unembedding = VARIANT.d_model * VARIANT.vocab_size
    assert llama.param_count(VARIANT) == {**counts, "matmul": counts["matmul"] + unembedding,
                                          "active": counts["matmul"] + unembedding}
    biases = VARIANT.n_layers * ((VARIANT.n_heads + 2 * VARIANT.kv_heads) * 8 + VARIANT.d_model)
    assert llama.param_count(VARIANT)["total"] == llama.param_count(CFG)["total"] + biases - unembedding


@pytest.mark.parametrize("name,total", [("llama_7b", 6_738_415_616), ("llama_13b", 13_015_864_320),
                                        ("llama_tiny", 791_680)])
def test_the_committed_configs_have_their_parameter_counts(name, total):
    """Llama-2's published sizes (and the README's for the tiny config), counted from the abstract leaves of the
    committed configs (nothing allocated)."""
    cfg = load_config(ROOT / "experiments" / f"{name}.yaml").model
    assert cfg.name == "llama"
    assert _counts(llama.abstract_params(cfg)[1])["total"] == llama.param_count(cfg)["total"] == total


def test_an_odd_head_dimension_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="'model.n_heads'.*even head dimension"):
        models.get(dataclasses.replace(CFG, d_model=36, n_heads=4))


@pytest.mark.parametrize("changes, named", [
    (dict(rope_factor=0.5), "'model.rope_factor' .*: must be >= 1"),
    (dict(rope_low_freq_factor=4.0), "'model.rope_high_freq_factor' .*: must exceed rope_low_freq_factor=4.0"),
    (dict(rope_original_max_positions=0), "'model.rope_original_max_positions' .*: must be >= 1"),
    (dict(name="gpt", tie_embeddings=True), "'model.tie_embeddings' .*: only the llama family has it"),
    (dict(name="gpt", qkv_bias=True), "'model.qkv_bias' .*: only the llama family has it"),
])
def test_bad_rope_scaling_and_variant_keys_are_refused_by_name(changes, named):
    with pytest.raises(ConfigError, match=named):
        load_config(None, [f"model.{k}={v}" for k, v in changes.items()])


@pytest.mark.compares_programs
def test_a_tied_head_is_refused_with_experts_and_borrows_the_embedding_as_a_stage():
    with pytest.raises(ConfigError, match="'model.tie_embeddings': a tied head is not implemented with mixture"):
        models.get(dataclasses.replace(VARIANT, moe=MoEConfig(experts=2)))
    staged = models.get(VARIANT)
    params = _random_params(VARIANT)
    parts = staged.split(params)
    assert set(parts[-1]) == {"norm"}  # the one matrix is the embedding stage's
    assert staged.borrows == {len(parts) - 1: 0}  # and the head reads it from there
    tokens = _tokens()[:, :-1]
    whole = nnx.merge(llama.abstract_params(VARIANT)[0], params)(tokens)
    np.testing.assert_allclose(np.asarray(staged.forward(parts, tokens)), np.asarray(whole), rtol=1e-5, atol=1e-5)


@pytest.mark.compares_programs
def test_a_tied_matrix_gets_the_gradients_of_both_its_uses():
    """The tied model's gradient of the embedding equals, in an untied model whose head holds a copy of it, the
    embedding's gradient plus the head's (transposed): one parameter, both uses' gradients summed."""
    tied_params = _random_params(VARIANT)
    untied_cfg = dataclasses.replace(VARIANT, tie_embeddings=False)
    matrix = tied_params["embed"]["tokens"]["embedding"]
    untied_params = {**tied_params, "head": {**tied_params["head"], "unembed": {"kernel": matrix.T}}}
    tokens = _tokens()

    def grads(cfg, params):
        graphdef, loss = llama.abstract_params(cfg)[0], models.get(cfg).loss
        return jax.jit(jax.grad(lambda p: loss(nnx.merge(graphdef, p)(tokens[:, :-1]), tokens[:, 1:])))(params)

    tied, untied = grads(VARIANT, tied_params), grads(untied_cfg, untied_params)
    both = untied["embed"]["tokens"]["embedding"] + untied["head"]["unembed"]["kernel"].T
    np.testing.assert_allclose(tied["embed"]["tokens"]["embedding"], both, rtol=1e-5, atol=1e-7)
    for one_use in (untied["embed"]["tokens"]["embedding"], untied["head"]["unembed"]["kernel"].T):
        assert np.abs(tied["embed"]["tokens"]["embedding"] - one_use).max() > 1e-3  # each use's share counts


def test_the_planning_estimates_count_this_familys_shapes():
    """`angel-jax plan --estimate`'s FLOPs and the device working set from the Llama block's own shapes (narrow k
    and v, three MLP matrices), not from a GPT block's (12 d^2 weights; q, k, v of d and two MLP activations)."""
    cfg = Config(model=CFG, train=TrainConfig(batch_size=B))
    d, T, V, L, D = CFG.d_model, CFG.seq_len, CFG.vocab_size, CFG.n_layers, CFG.d_model // CFG.n_heads
    tokens = B * T
    counts = llama.param_count(CFG)
    block_weights = (counts["total"] - 2 * V * d - d) // L  # less the embedding, the unembedding, the head's norm
    costs = estimate_costs(cfg, blueprint(cfg), 1e12, 1e9, 1e9)
    assert costs[1].forward_s * 1e12 == pytest.approx(2 * tokens * block_weights + 4 * tokens * T * d, rel=1e-9)
    assert costs[-1].backward_s * 1e12 == pytest.approx(3 * 2 * tokens * (d * V + d), rel=1e-9)
    width = (CFG.n_heads + 2 * CFG.kv_heads) * D + 3 * CFG.hidden  # q, k, v; gate, up, their product
    block = tokens * width * 4 * 2 + B * CFG.n_heads * T * T * 4
    assert block > 3 * tokens * V * 4  # the block's working set is the larger, so it is the one counted
    assert fixed_device_bytes(cfg, B, blueprint(cfg).sizes) == (L + 1) * tokens * d * 4 + block + tokens * 8


# ---------------------------------------------------------------------------------------------- decoding


@pytest.mark.compares_programs
@pytest.mark.parametrize("cfg", [CFG, VARIANT], ids=["plain", "variant"])
def test_prefill_and_one_token_steps_equal_the_whole_sequence_forward(cfg):
    staged = models.get(cfg)
    params = _random_params(cfg)
    tokens = _tokens(CFG.seq_len)
    whole = np.asarray(_forward(cfg)(params, tokens))
    decode = jax.jit(staged.decode)  # pos traced: one program per token count
    cache = staged.init_cache(B, CFG.seq_len + 4)
    assert cache["k"].shape == (CFG.n_layers, B, CFG.seq_len + 4, CFG.kv_heads, CFG.d_model // CFG.n_heads)
    prompt = 9
    logits, cache = decode(params, cache, tokens[:, :prompt], jnp.int32(0))
    got = [np.asarray(logits)]
    for pos in range(prompt, 12):  # one token at a time
        logits, cache = decode(params, cache, tokens[:, pos:pos + 1], jnp.int32(pos))
        got.append(np.asarray(logits))
    logits, cache = decode(params, cache, tokens[:, 12:], jnp.int32(12))  # a chunk after the steps
    got.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(got, axis=1), whole, rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(cache["k"][:, :, CFG.seq_len:])).max() == 0  # slots past the last position unused


# ------------------------------------------------------------------------------------------------ training

# Deep and narrow like test_paged's GPT (state large next to activations, so that an eighth of it holds the
# step's activations and a streaming window), and a block the size of test_paged's page (197,120 B of 200,704).
TRAIN_MODEL = ModelConfig(name="llama", d_model=64, n_layers=12, n_heads=2, n_kv_heads=1, mlp_hidden=192,
                          seq_len=16, compute_dtype="float32")


@pytest.mark.compares_programs
def test_paged_training_with_an_eighth_of_the_state_on_the_device_matches_the_reference():
    cfg = eighth(_cfg("adamw", steps=6, model=TRAIN_MODEL))
    data = batches(6, model=TRAIN_MODEL)
    ref_losses, _ = reference(cfg, data)
    losses, _, engine = paged(cfg, data)
    assert_mostly_streamed(engine, cfg)
    assert ref_losses[-1] < ref_losses[0] - 0.2, ref_losses  # it learns, so errors would compound
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
