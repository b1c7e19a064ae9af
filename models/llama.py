"""A Llama decoder in Flax NNX: RMSNorm pre-norm blocks, rotary position embeddings, grouped-query attention, a
SwiGLU MLP, no biases by default; bf16 compute over fp32 parameters.

The layout follows Hugging Face's `LlamaForCausalLM` one module for one module, so its weights load with a plain
copy (each `nn.Linear` weight transposed into an `nnx.Linear` kernel, nothing permuted):

    embed.tokens.embedding          model.embed_tokens.weight
    blocks.attn_norm.scale [L]      model.layers.*.input_layernorm.weight
    blocks.q / k / v / o.kernel     model.layers.*.self_attn.{q,k,v,o}_proj.weight (transposed)
    blocks.mlp_norm.scale           model.layers.*.post_attention_layernorm.weight
    blocks.gate / up / down.kernel  model.layers.*.mlp.{gate,up,down}_proj.weight (transposed)
    head.norm.scale                 model.norm.weight
    head.unembed.kernel             lm_head.weight (transposed)

Rotary embeddings use Hugging Face's convention (`rotate_half`: the head dimension's two halves are the pairs
that rotate together), not the interleaved one of Meta's original code, whose q/k weights are permuted on import.
With model.rope_scaling: llama3 their frequencies get Llama 3.1's adjustment (`llama3_frequencies`).

Variants of the same layout: model.qkv_bias adds biases to q, k and v (Qwen2's `*_proj.bias`), model.o_bias to o
(Llama's attention_bias sets both: blocks.q.bias is self_attn.q_proj.bias, ...). With model.tie_embeddings the head
has no `unembed`: it multiplies by the embedding matrix transposed (`nnx.Embed.attend`), one parameter for both
uses, whose gradient is the sum of both uses'. In the stage view the embedding stage owns the matrix (`split` and
`merge` give it there, which is what export writes) and the head borrows it (`StagedModel.borrows`): the head's
apply takes (its own parameters, the embedding stage's), and the paged engine adds the head's gradient of the
matrix into the embedding stage's before that stage's one update.

As in `models/gpt.py`, the blocks are created stacked (leading axis n_layers, through `nnx.vmap`) so one
`jax.lax.scan` body runs them, and stage i (0 = embed, 1 + j = block j, n_layers + 1 = head) draws its parameters
from `fold_in(key(seed), i)` alone, so `init_stage` gives one stage bit-identical to the whole model's split.
Sampling runs through a key/value cache stacked over the layers ([L, B, S, K, D]), which `decode` scans with the
blocks.

Instruction data (angel_jax/data/marks.py): the embedding reads token ids through their in-band marks and the loss
counts only the scored targets (models/common.py `cross_entropy`). Packed rows (`staged(cfg, documents=True)`):
the stages pass the documents' segments on with the stream, attention stays within a document and the rotary
positions count from each document's start (models/documents.py), with MoE blocks as without.

Mixture of experts (model.moe.experts > 0): every moe.every-th block has a mixture of SwiGLU experts
(models/moe.py) in place of its MLP, as in the GPT (models/moe_decoder.py); it samples with the same cache.
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from angel_jax.data import marks as token_marks
from angel_jax.config import ConfigError, ModelConfig
from models.attention import cached_attention, causal_attention
from models import documents as documents_lib, moe_decoder
from models.common import (Linear, abstract_params_of, cross_entropy, dot_general, family_functions,
                           one_stage_params, stage_key, whole_params)
from models.moe import MoE, MoEFigures
from models.stages import PlannerHints, Stage, StagedModel

_INIT_STD = 0.02

Params = dict
"""Model parameters as a plain nested dict of arrays (`nnx.to_pure_dict(state)`)."""

Cache = dict
"""{'k': [n_layers, B, S, kv_heads, head_dim], 'v': the same} in the compute dtype: layer l's keys and values of
positions 0 .. S-1 (those not written yet are zeros and masked)."""


def _dtypes(cfg: ModelConfig) -> tuple[jnp.dtype, jnp.dtype]:
    return jnp.dtype(cfg.compute_dtype), jnp.dtype(cfg.param_dtype)


def head_dim(cfg: ModelConfig) -> int:
    return cfg.d_model // cfg.n_heads


# ------------------------------------------------------------------------------------------------------- RoPE


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1's RoPE frequency adjustment (model.rope_scaling: llama3 and its rope_* keys)."""

    factor: float
    """How much a long wavelength is stretched (rope_factor)."""
    low_freq_factor: float
    """Wavelengths above original_max_positions / low_freq_factor are stretched by `factor`."""
    high_freq_factor: float
    """Wavelengths below original_max_positions / high_freq_factor are kept."""
    original_max_positions: int
    """The context length the model was pretrained at."""


def rope_scaling(cfg: ModelConfig) -> Llama3Scaling | None:
    """The config's RoPE scaling, None for plain RoPE."""
    if cfg.rope_scaling == "none":
        return None
    return Llama3Scaling(cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                         cfg.rope_original_max_positions)


def llama3_frequencies(inv_freq: jax.Array, s: Llama3Scaling) -> jax.Array:
    """RoPE frequencies adjusted as transformers' `_compute_llama3_parameters` does, in float32 as there: a
    wavelength longer than original_max_positions / low_freq_factor (a rotation the original context saw little
    of) is stretched by `factor`, so that factor x the original context turns it no further than pretraining did;
    one shorter than original_max_positions / high_freq_factor (local position detail) is kept; those between move
    smoothly from one to the other."""
    low_freq_wavelen = s.original_max_positions / s.low_freq_factor
    high_freq_wavelen = s.original_max_positions / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    stretched = jnp.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_positions / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * stretched / s.factor + smooth * stretched
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return jnp.where(medium, smoothed, stretched)


def rope_frequencies(dim: int, theta: float, scaling: Llama3Scaling | None = None) -> jax.Array:
    """The dim/2 rotation frequencies (float32): theta^(-2j/dim) for j < dim/2, adjusted by `scaling`."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    return inv_freq if scaling is None else llama3_frequencies(inv_freq, scaling)


def rope_angles(positions: jax.Array, dim: int, theta: float, scaling: Llama3Scaling | None = None
                ) -> tuple[jax.Array, jax.Array]:
    """cos and sin [T, dim] (float32) of the rotation at each position of `positions` [T] ([B, T, dim] for
    positions [B, T]): frequency j (`rope_frequencies`) for j < dim/2, repeated for the second half
    (`concat([freqs, freqs])`, Hugging Face's layout)."""
    inv_freq = rope_frequencies(dim, theta, scaling)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [B, T, heads, dim] by the angles of its positions (cos, sin [T, dim] or [B, T, dim]): x * cos +
    rotate_half(x) * sin, where rotate_half(x) = concat([-x2, x1]) of x's halves x1, x2 (dimension j rotates with
    j + dim/2). In float32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos[..., None, :] + rotated * sin[..., None, :]).astype(x.dtype)


# ---------------------------------------------------------------------------------------------------- modules


class Embed(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        cdt, pdt = _dtypes(cfg)
        self.tokens = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=cdt, param_dtype=pdt,
                                embedding_init=nnx.initializers.normal(_INIT_STD), rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Tokens [B, T], ids with their in-band marks. No position embedding: positions enter attention through
        RoPE."""
        return self.tokens(token_marks.token_ids(tokens))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, moe: bool = False):
        """`moe`: a mixture of SwiGLU experts (models/moe.py, model.moe) in place of the MLP; call it with
        `routed`."""
        cdt, pdt = _dtypes(cfg)
        d, hidden, hd = cfg.d_model, cfg.hidden, head_dim(cfg)
        init = nnx.initializers.normal(_INIT_STD)
        # As the GPT: residual projections scaled by 1/sqrt(2 * depth) so the stream's variance does not grow with
        # depth when training from scratch (imported weights replace all of this).
        out_init = nnx.initializers.normal(_INIT_STD / (2 * cfg.n_layers) ** 0.5)
        lin = dict(use_bias=False, dtype=cdt, param_dtype=pdt, cpu_fp32=cfg.cpu_matmul_fp32, rngs=rngs)
        qkv = {**lin, "use_bias": cfg.qkv_bias}  # biases start at zero (nnx.Linear's default)
        norm = dict(epsilon=cfg.norm_eps, dtype=cdt, param_dtype=pdt, rngs=rngs)
        self.attn_norm = nnx.RMSNorm(d, **norm)
        self.q = Linear(d, cfg.n_heads * hd, kernel_init=init, **qkv)
        self.k = Linear(d, cfg.kv_heads * hd, kernel_init=init, **qkv)
        self.v = Linear(d, cfg.kv_heads * hd, kernel_init=init, **qkv)
        self.o = Linear(cfg.n_heads * hd, d, kernel_init=out_init, **{**lin, "use_bias": cfg.o_bias})
        self.mlp_norm = nnx.RMSNorm(d, **norm)
        if moe:
            self.moe = MoE(cfg, gated=True, out_std=_INIT_STD / (2 * cfg.n_layers) ** 0.5, rngs=rngs)
        else:
            self.gate = Linear(d, hidden, kernel_init=init, **lin)
            self.up = Linear(d, hidden, kernel_init=init, **lin)
            self.down = Linear(hidden, d, kernel_init=out_init, **lin)
        self.n_heads, self.kv_heads, self.head_dim, self.rope_theta = cfg.n_heads, cfg.kv_heads, hd, cfg.rope_theta
        self.rope_scaling = rope_scaling(cfg)
        self.cpu_fp32 = cfg.cpu_matmul_fp32

    def _qkv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q = self.q(h).reshape(b, t, self.n_heads, self.head_dim)
        k = self.k(h).reshape(b, t, self.kv_heads, self.head_dim)
        v = self.v(h).reshape(b, t, self.kv_heads, self.head_dim)
        cos, sin = rope_angles(positions, self.head_dim, self.rope_theta, self.rope_scaling)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _rest(self, x: jax.Array, attn: jax.Array) -> jax.Array:
        """The attention output projection and the SwiGLU MLP, each added to the residual stream."""
        x = self._attention_residual(x, attn)
        h = self.mlp_norm(x)
        return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))

    def _attention_residual(self, x: jax.Array, attn: jax.Array) -> jax.Array:
        b, t, _ = x.shape
        return x + self.o(attn.reshape(b, t, self.n_heads * self.head_dim))

    def __call__(self, x: jax.Array, segments: jax.Array | None = None) -> jax.Array:
        """`segments`: packed documents (models/documents.py), each attending only to itself, at positions from
        its start."""
        positions = jnp.arange(x.shape[1]) if segments is None else documents_lib.positions_in(segments)
        q, k, v = self._qkv(x, positions)
        return self._rest(x, causal_attention(q, k, v, segments, cpu_fp32=self.cpu_fp32))

    def routed(self, x: jax.Array, segments: jax.Array | None = None) -> tuple[jax.Array, MoEFigures]:
        """An MoE block's forward: its output and its MoE layer's figures (`segments` as for `__call__`)."""
        positions = jnp.arange(x.shape[1]) if segments is None else documents_lib.positions_in(segments)
        q, k, v = self._qkv(x, positions)
        x = self._attention_residual(x, causal_attention(q, k, v, segments, cpu_fp32=self.cpu_fp32))
        y, figures = self.moe(self.mlp_norm(x))
        return x + y, figures

    def decode(self, x: jax.Array, cache_k: jax.Array, cache_v: jax.Array, pos: jax.Array
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, T, d] at positions pos .. pos+T-1 over this layer's cache [B, S, K, D]: (output, new k, new v)."""
        q, k, v = self._qkv(x, pos + jnp.arange(x.shape[1]))
        attn, cache_k, cache_v = cached_attention(q, k, v, cache_k, cache_v, pos, cpu_fp32=self.cpu_fp32)
        return self._rest(x, attn), cache_k, cache_v

    def routed_decode(self, x: jax.Array, cache_k: jax.Array, cache_v: jax.Array, pos: jax.Array
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """An MoE block's `decode`: its experts route without dropping a token (`MoE.__call__(drop=False)`)."""
        q, k, v = self._qkv(x, pos + jnp.arange(x.shape[1]))
        attn, cache_k, cache_v = cached_attention(q, k, v, cache_k, cache_v, pos, cpu_fp32=self.cpu_fp32)
        x = self._attention_residual(x, attn)
        return x + self.moe(self.mlp_norm(x), drop=False)[0], cache_k, cache_v


class Head(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        cdt, pdt = _dtypes(cfg)
        self.norm = nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, dtype=cdt, param_dtype=pdt, rngs=rngs)
        self.tied = cfg.tie_embeddings
        self.compute_dtype, self.cpu_fp32 = cdt, cfg.cpu_matmul_fp32
        if not self.tied:  # tied: the embedding's matrix unembeds, the head owns none
            self.unembed = Linear(cfg.d_model, cfg.vocab_size, use_bias=False, dtype=cdt, param_dtype=pdt,
                                      cpu_fp32=cfg.cpu_matmul_fp32,
                                      kernel_init=nnx.initializers.normal(_INIT_STD), rngs=rngs)

    def __call__(self, x: jax.Array, embed: Embed | None = None) -> jax.Array:
        """float32 logits; a tied head needs the model's `embed`."""
        h = self.norm(x)
        if self.tied:
            if embed is None:
                raise ValueError("a tied head unembeds with the embedding's matrix: pass the model's `embed`")
            # h @ embedding.T in the compute dtype (nnx.Embed.attend's product, through the families' matmul rule)
            logits = dot_general(h, embed.tokens.embedding[...], (((h.ndim - 1,), (1,)), ((), ())),
                                 dtype=self.compute_dtype, cpu_fp32=self.cpu_fp32)
            return logits.astype(jnp.float32)
        return self.unembed(h).astype(jnp.float32)


class Llama(nnx.Module):
    def __init__(self, cfg: ModelConfig, key: jax.Array, documents: bool = False):
        """`key`: the model's base key (`jax.random.key(seed)`); each stage uses only `stage_key(key, i)`.
        `documents`: rows hold packed documents (models/documents.py); the parameters are the same."""
        self.cfg = cfg
        self.documents = documents
        self.embed = Embed(cfg, nnx.Rngs(params=stage_key(key, 0)))

        moe_decoder.add_blocks(self, cfg, key, Block)
        self.head = Head(cfg, nnx.Rngs(params=stage_key(key, cfg.n_layers + 1)))

    def __call__(self, tokens: jax.Array) -> jax.Array | moe_decoder.Stream:
        """Logits; with MoE blocks, a `moe_decoder.Stream` of the logits and the auxiliary sums."""
        segments = documents_lib.segments_of(tokens) if self.documents else None
        if self.cfg.moe.experts:
            block_def, block_state = nnx.split(self.blocks) if hasattr(self, "blocks") else (None, None)
            moe_def, moe_state = nnx.split(self.moe_blocks)
            s = moe_decoder.run_blocks(self.cfg, block_def, block_state, moe_def, moe_state,
                                       moe_decoder.start(self.embed(tokens), segments))
            return moe_decoder.finish(self.head, s)
        block_def, block_state = nnx.split(self.blocks)

        def body(h: jax.Array, params: Params) -> tuple[jax.Array, None]:
            return nnx.merge(block_def, params)(h, segments), None

        x, _ = scan_layers(body, self.embed(tokens), block_state, scan=self.cfg.scan_blocks, remat=self.cfg.remat)
        return self.head(x, self.embed)

    def decode(self, tokens: jax.Array, cache: Cache, pos: jax.Array) -> tuple[jax.Array, Cache]:
        """Logits of tokens [B, T] at positions pos .. pos+T-1, and the cache with their keys and values added."""
        block_def, block_state = nnx.split(self.blocks)

        def body(h: jax.Array, layer: tuple) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
            params, cache_k, cache_v = layer
            h, cache_k, cache_v = nnx.merge(block_def, params).decode(h, cache_k, cache_v, pos)
            return h, (cache_k, cache_v)

        x, (k, v) = scan_layers(body, self.embed(tokens), (block_state, cache["k"], cache["v"]),
                                scan=self.cfg.scan_blocks, remat=False)
        return self.head(x, self.embed), {"k": k, "v": v}


def scan_layers(body: Callable[[jax.Array, Any], tuple[jax.Array, Any]], x: jax.Array, per_layer: Any, *,
                scan: bool, remat: bool) -> tuple[jax.Array, Any]:
    """Thread x through `body` once per layer (the leading axis of `per_layer`), scanned (one compiled body) or
    unrolled; returns (x, body's per-layer outputs stacked)."""
    if remat:
        body = jax.checkpoint(body)
    if scan:
        return jax.lax.scan(body, x, per_layer)
    outs = []
    for i in range(jax.tree.leaves(per_layer)[0].shape[0]):
        x, out = body(x, jax.tree.map(lambda a: a[i], per_layer))
        outs.append(out)
    return x, jax.tree.map(lambda *ys: jnp.stack(ys), *outs)


# ------------------------------------------------------------------------------------------ init and stages


def check(cfg: ModelConfig) -> None:
    """What this family needs beyond ModelConfig's own checks."""
    if head_dim(cfg) % 2:
        raise ConfigError(f"'model.n_heads': rotary embeddings need an even head dimension, but d_model "
                          f"{cfg.d_model} / n_heads {cfg.n_heads} = {head_dim(cfg)}")
    if cfg.tie_embeddings and cfg.moe.experts:  # the MoE decoder's head (models/moe_decoder.py) is untied
        raise ConfigError("'model.tie_embeddings': a tied head is not implemented with mixture-of-experts blocks "
                          "(model.moe.experts > 0)")


def init(cfg: ModelConfig, seed: int, documents: bool = False) -> tuple[nnx.GraphDef, Params]:
    """Build the model and return (graphdef, params). Only nnx.Param state exists in this model. `documents`: the
    graphdef runs rows of packed documents."""
    return whole_params(functools.partial(Llama, documents=documents), cfg, seed)


def init_stage(cfg: ModelConfig, seed: int, stage: int) -> Params:
    """Stage `stage`'s params alone (embed, block j = stage 1 + j, or head), equal bit for bit to
    `staged(cfg).split(init(cfg, seed)[1])[stage]`; only that stage's arrays are created."""
    return one_stage_params(seed, stage, cfg.n_layers + 2, moe_decoder.decoder_stage(cfg, Embed, Block, Head))


def abstract_params(cfg: ModelConfig, documents: bool = False) -> tuple[nnx.GraphDef, Params]:
    """(graphdef, params as jax.ShapeDtypeStruct) without allocating anything (`documents` as for `init`)."""
    return abstract_params_of(functools.partial(Llama, documents=documents), cfg)


def init_cache(cfg: ModelConfig, batch: int, max_len: int) -> Cache:
    """An empty cache for `batch` sequences of up to `max_len` positions (RoPE has no length limit of its own:
    max_len may exceed seq_len, the length trained on)."""
    shape = (cfg.n_layers, batch, max_len, cfg.kv_heads, head_dim(cfg))
    return {"k": jnp.zeros(shape, cfg.compute_dtype), "v": jnp.zeros(shape, cfg.compute_dtype)}


def embed_at(embed: Embed, tokens: jax.Array, pos: jax.Array) -> jax.Array:
    """Tokens [B, T] embedded (positions enter through the rotary attention, not here)."""
    return embed(tokens)


def staged(cfg: ModelConfig, documents: bool = False) -> StagedModel:
    """The stage view of the model: embed, n_layers homogeneous blocks, head. `documents`: rows of packed
    documents (models/documents.py), a `Packed` between the stages."""
    check(cfg)
    abstract = nnx.eval_shape(lambda: Llama(cfg, jax.random.key(0)))
    if cfg.moe.experts:
        return _staged_moe(cfg, abstract, documents)
    graphdef = nnx.graphdef(abstract)
    embed_def = nnx.graphdef(abstract.embed)
    block_def = nnx.graphdef(abstract.blocks)
    head_def = nnx.graphdef(abstract.head)

    def apply_block(params: Params, x: jax.Array, segments: jax.Array | None = None) -> jax.Array:
        return nnx.merge(block_def, params)(x, segments)

    remat = jax.checkpoint if cfg.remat else (lambda f: f)
    if cfg.tie_embeddings:  # the head borrows the embedding stage's parameters: (its own, the embedding's)
        head = lambda p, x: nnx.merge(head_def, p[0])(x, nnx.merge(embed_def, p[1]))  # noqa: E731
    else:
        head = lambda p, x: nnx.merge(head_def, p)(x)  # noqa: E731
    if documents:
        apply = documents_lib.stage_apply(lambda p, tokens, _: nnx.merge(embed_def, p)(tokens), remat(apply_block),
                                          head)
    else:
        apply = {"embed": lambda p, tokens: nnx.merge(embed_def, p)(tokens), "block": remat(apply_block),
                 "head": head}

    def split(params: Params) -> list[Params]:
        blocks = params["blocks"]
        return ([params["embed"]]
                + [jax.tree.map(lambda a, i=i: a[i], blocks) for i in range(cfg.n_layers)]
                + [params["head"]])

    def merge(stage_params: list[Params]) -> Params:
        embed, *blocks, head = stage_params
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)
        return {"embed": embed, "blocks": stacked, "head": head}

    def decode(params: Params, cache: Cache, tokens: jax.Array, pos: jax.Array) -> tuple[jax.Array, Cache]:
        return nnx.merge(graphdef, params).decode(tokens, cache, jnp.asarray(pos, jnp.int32))

    stages = (Stage("embed", "embed"),) + tuple(Stage(f"block.{i}", "block") for i in range(cfg.n_layers)) \
        + (Stage("head", "head"),)
    return StagedModel(
        stages=stages,
        apply=apply,
        loss=cross_entropy,
        split=split,
        merge=merge,
        **family_functions(sys.modules[__name__], cfg, documents),
        # q, k, v; gate, up and their product (silu(gate) is fused into the product)
        hints=PlannerHints(block_activation_width=(cfg.n_heads + 2 * cfg.kv_heads) * head_dim(cfg) + 3 * cfg.hidden),
        init_cache=lambda batch, max_len: init_cache(cfg, batch, max_len),
        decode=decode,
        borrows={cfg.n_layers + 1: 0} if cfg.tie_embeddings else {},
    )


def _staged_moe(cfg: ModelConfig, abstract: Llama, documents: bool) -> StagedModel:
    """The stage view with MoE blocks (models/moe_decoder.py); `documents`: rows of packed documents (the
    embedding is the same: their positions enter through the blocks' rotary attention)."""
    dense_width = (cfg.n_heads + 2 * cfg.kv_heads) * head_dim(cfg) + 3 * cfg.hidden
    width = max(dense_width, dense_width - 3 * cfg.hidden + moe_decoder.routed_width(cfg, 3))
    embed_documents = (lambda embed, tokens, _: embed(tokens)) if documents else None
    return moe_decoder.staged(cfg, abstract, sys.modules[__name__], width, embed_documents)


def param_count(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts: total, the part that enters matmuls (excludes the embedding lookup, the norms and the
    biases; a tied head's matrix is counted there as the unembedding, and once in total), and of that the part one
    token's computation uses ('active': with MoE blocks, top_k experts of each)."""
    d, hidden, L, V = cfg.d_model, cfg.hidden, cfg.n_layers, cfg.vocab_size
    q_width, kv_width = cfg.n_heads * head_dim(cfg), cfg.kv_heads * head_dim(cfg)
    attention = d * q_width + 2 * d * kv_width + q_width * d  # q, k, v, o
    per_block_matmul = attention + 3 * d * hidden  # gate, up, down
    per_block_vectors = 2 * d + cfg.qkv_bias * (q_width + 2 * kv_width) + cfg.o_bias * d  # norms, biases
    unembed = 0 if cfg.tie_embeddings else d * V  # tied: the embedding matrix, counted once
    routed = moe_decoder.moe_layers(cfg)
    moe_matmul, moe_active = moe_decoder.matmul_params(cfg, attention, 3 * d * hidden)
    dense = L - routed
    return {
        "total": V * d + dense * per_block_matmul + routed * moe_matmul + L * per_block_vectors + d + unembed,
        "matmul": dense * per_block_matmul + routed * moe_matmul + d * V,
        "active": dense * per_block_matmul + routed * moe_active + d * V,
    }


def flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token (forward + backward), the PaLM formula as for the GPT: 6 * N_matmul + 12 * L * d * T.

    N_matmul counts the weights that enter matrix products (q, k, v, o, gate, up, down and the unembedding; with
    grouped-query attention k and v are narrower, and N_matmul says so); the second term is attention's QK^T and
    AV over the full T x T square, whose width is n_heads * head_dim = d_model whatever the number of key/value
    heads. Model FLOPs: rematerialisation and RoPE's elementwise work are not counted. With MoE blocks N_matmul is
    `param_count`'s 'active': the router and the top_k experts a token is routed to.
    """
    return 6.0 * param_count(cfg)["active"] + 12.0 * cfg.n_layers * cfg.d_model * cfg.seq_len
