"""A Llama decoder in Flax NNX: RMSNorm pre-norm blocks, rotary position embeddings, grouped-query attention, a
SwiGLU MLP, no biases; bf16 compute over fp32 parameters.

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
The embedding and the unembedding are separate matrices: each stage owns its parameters.

As in `models/gpt.py`, the blocks are created stacked (leading axis n_layers, through `nnx.vmap`) so one
`jax.lax.scan` body runs them, and stage i (0 = embed, 1 + j = block j, n_layers + 1 = head) draws its parameters
from `fold_in(key(seed), i)` alone, so `init_stage` gives one stage bit-identical to the whole model's split.
Sampling runs through a key/value cache stacked over the layers ([L, B, S, K, D]), which `decode` scans with the
blocks.

Mixture of experts (model.moe.experts > 0): every moe.every-th block has a mixture of SwiGLU experts
(models/moe.py) in place of its MLP, as in the GPT (models/moe_decoder.py); it samples with the same cache.
"""

from __future__ import annotations

from typing import Any, Callable

import sys

import jax
import jax.numpy as jnp
from flax import nnx

from angel_jax.config import ConfigError, ModelConfig
from models.attention import cached_attention, causal_attention
from models import moe_decoder
from models.common import abstract_params_of, cross_entropy, family_functions, one_stage_params, stage_key, whole_params
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


def rope_angles(positions: jax.Array, dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin [T, dim] (float32) of the rotation at each position: frequency j = theta^(-2j/dim) for j < dim/2,
    repeated for the second half (`concat([freqs, freqs])`, Hugging Face's layout)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [B, T, heads, dim] by the angles of its positions: x * cos + rotate_half(x) * sin, where
    rotate_half(x) = concat([-x2, x1]) of x's halves x1, x2 (dimension j rotates with j + dim/2). In float32,
    returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos[:, None, :] + rotated * sin[:, None, :]).astype(x.dtype)


# ---------------------------------------------------------------------------------------------------- modules


class Embed(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        cdt, pdt = _dtypes(cfg)
        self.tokens = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=cdt, param_dtype=pdt,
                                embedding_init=nnx.initializers.normal(_INIT_STD), rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.tokens(tokens)  # no position embedding: positions enter attention through RoPE


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
        lin = dict(use_bias=False, dtype=cdt, param_dtype=pdt, rngs=rngs)
        norm = dict(epsilon=cfg.norm_eps, dtype=cdt, param_dtype=pdt, rngs=rngs)
        self.attn_norm = nnx.RMSNorm(d, **norm)
        self.q = nnx.Linear(d, cfg.n_heads * hd, kernel_init=init, **lin)
        self.k = nnx.Linear(d, cfg.kv_heads * hd, kernel_init=init, **lin)
        self.v = nnx.Linear(d, cfg.kv_heads * hd, kernel_init=init, **lin)
        self.o = nnx.Linear(cfg.n_heads * hd, d, kernel_init=out_init, **lin)
        self.mlp_norm = nnx.RMSNorm(d, **norm)
        if moe:
            self.moe = MoE(cfg, gated=True, out_std=_INIT_STD / (2 * cfg.n_layers) ** 0.5, rngs=rngs)
        else:
            self.gate = nnx.Linear(d, hidden, kernel_init=init, **lin)
            self.up = nnx.Linear(d, hidden, kernel_init=init, **lin)
            self.down = nnx.Linear(hidden, d, kernel_init=out_init, **lin)
        self.n_heads, self.kv_heads, self.head_dim, self.rope_theta = cfg.n_heads, cfg.kv_heads, hd, cfg.rope_theta

    def _qkv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q = self.q(h).reshape(b, t, self.n_heads, self.head_dim)
        k = self.k(h).reshape(b, t, self.kv_heads, self.head_dim)
        v = self.v(h).reshape(b, t, self.kv_heads, self.head_dim)
        cos, sin = rope_angles(positions, self.head_dim, self.rope_theta)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _rest(self, x: jax.Array, attn: jax.Array) -> jax.Array:
        """The attention output projection and the SwiGLU MLP, each added to the residual stream."""
        x = self._attention_residual(x, attn)
        h = self.mlp_norm(x)
        return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))

    def _attention_residual(self, x: jax.Array, attn: jax.Array) -> jax.Array:
        b, t, _ = x.shape
        return x + self.o(attn.reshape(b, t, self.n_heads * self.head_dim))

    def __call__(self, x: jax.Array) -> jax.Array:
        q, k, v = self._qkv(x, jnp.arange(x.shape[1]))
        return self._rest(x, causal_attention(q, k, v))

    def routed(self, x: jax.Array) -> tuple[jax.Array, MoEFigures]:
        """An MoE block's forward: its output and its MoE layer's figures."""
        q, k, v = self._qkv(x, jnp.arange(x.shape[1]))
        x = self._attention_residual(x, causal_attention(q, k, v))
        y, figures = self.moe(self.mlp_norm(x))
        return x + y, figures

    def decode(self, x: jax.Array, cache_k: jax.Array, cache_v: jax.Array, pos: jax.Array
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, T, d] at positions pos .. pos+T-1 over this layer's cache [B, S, K, D]: (output, new k, new v)."""
        q, k, v = self._qkv(x, pos + jnp.arange(x.shape[1]))
        attn, cache_k, cache_v = cached_attention(q, k, v, cache_k, cache_v, pos)
        return self._rest(x, attn), cache_k, cache_v

    def routed_decode(self, x: jax.Array, cache_k: jax.Array, cache_v: jax.Array, pos: jax.Array
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """An MoE block's `decode`: its experts route without dropping a token (`MoE.__call__(drop=False)`)."""
        q, k, v = self._qkv(x, pos + jnp.arange(x.shape[1]))
        attn, cache_k, cache_v = cached_attention(q, k, v, cache_k, cache_v, pos)
        x = self._attention_residual(x, attn)
        return x + self.moe(self.mlp_norm(x), drop=False)[0], cache_k, cache_v


class Head(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        cdt, pdt = _dtypes(cfg)
        self.norm = nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, dtype=cdt, param_dtype=pdt, rngs=rngs)
        self.unembed = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, dtype=cdt, param_dtype=pdt,
                                  kernel_init=nnx.initializers.normal(_INIT_STD), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.unembed(self.norm(x)).astype(jnp.float32)


class Llama(nnx.Module):
    def __init__(self, cfg: ModelConfig, key: jax.Array):
        """`key`: the model's base key (`jax.random.key(seed)`); each stage uses only `stage_key(key, i)`."""
        self.cfg = cfg
        self.embed = Embed(cfg, nnx.Rngs(params=stage_key(key, 0)))

        moe_decoder.add_blocks(self, cfg, key, Block)
        self.head = Head(cfg, nnx.Rngs(params=stage_key(key, cfg.n_layers + 1)))

    def __call__(self, tokens: jax.Array) -> jax.Array | moe_decoder.Stream:
        """Logits; with MoE blocks, a `moe_decoder.Stream` of the logits and the auxiliary sums."""
        if self.cfg.moe.experts:
            block_def, block_state = nnx.split(self.blocks) if hasattr(self, "blocks") else (None, None)
            moe_def, moe_state = nnx.split(self.moe_blocks)
            s = moe_decoder.run_blocks(self.cfg, block_def, block_state, moe_def, moe_state,
                                       moe_decoder.start(self.embed(tokens)))
            return moe_decoder.finish(self.head, s)
        block_def, block_state = nnx.split(self.blocks)

        def body(h: jax.Array, params: Params) -> tuple[jax.Array, None]:
            return nnx.merge(block_def, params)(h), None

        x, _ = scan_layers(body, self.embed(tokens), block_state, scan=self.cfg.scan_blocks, remat=self.cfg.remat)
        return self.head(x)

    def decode(self, tokens: jax.Array, cache: Cache, pos: jax.Array) -> tuple[jax.Array, Cache]:
        """Logits of tokens [B, T] at positions pos .. pos+T-1, and the cache with their keys and values added."""
        block_def, block_state = nnx.split(self.blocks)

        def body(h: jax.Array, layer: tuple) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
            params, cache_k, cache_v = layer
            h, cache_k, cache_v = nnx.merge(block_def, params).decode(h, cache_k, cache_v, pos)
            return h, (cache_k, cache_v)

        x, (k, v) = scan_layers(body, self.embed(tokens), (block_state, cache["k"], cache["v"]),
                                scan=self.cfg.scan_blocks, remat=False)
        return self.head(x), {"k": k, "v": v}


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


def init(cfg: ModelConfig, seed: int) -> tuple[nnx.GraphDef, Params]:
    """Build the model and return (graphdef, params). Only nnx.Param state exists in this model."""
    return whole_params(Llama, cfg, seed)


def init_stage(cfg: ModelConfig, seed: int, stage: int) -> Params:
    """Stage `stage`'s params alone (embed, block j = stage 1 + j, or head), equal bit for bit to
    `staged(cfg).split(init(cfg, seed)[1])[stage]`; only that stage's arrays are created."""
    return one_stage_params(seed, stage, cfg.n_layers + 2, moe_decoder.decoder_stage(cfg, Embed, Block, Head))


def abstract_params(cfg: ModelConfig) -> tuple[nnx.GraphDef, Params]:
    """(graphdef, params as jax.ShapeDtypeStruct) without allocating anything."""
    return abstract_params_of(Llama, cfg)


def init_cache(cfg: ModelConfig, batch: int, max_len: int) -> Cache:
    """An empty cache for `batch` sequences of up to `max_len` positions (RoPE has no length limit of its own:
    max_len may exceed seq_len, the length trained on)."""
    shape = (cfg.n_layers, batch, max_len, cfg.kv_heads, head_dim(cfg))
    return {"k": jnp.zeros(shape, cfg.compute_dtype), "v": jnp.zeros(shape, cfg.compute_dtype)}


def embed_at(embed: Embed, tokens: jax.Array, pos: jax.Array) -> jax.Array:
    """Tokens [B, T] embedded (positions enter through the rotary attention, not here)."""
    return embed(tokens)


def staged(cfg: ModelConfig) -> StagedModel:
    """The stage view of the model: embed, n_layers homogeneous blocks, head."""
    check(cfg)
    abstract = nnx.eval_shape(lambda: Llama(cfg, jax.random.key(0)))
    if cfg.moe.experts:
        return _staged_moe(cfg, abstract)
    graphdef = nnx.graphdef(abstract)
    embed_def = nnx.graphdef(abstract.embed)
    block_def = nnx.graphdef(abstract.blocks)
    head_def = nnx.graphdef(abstract.head)

    def apply_block(params: Params, x: jax.Array) -> jax.Array:
        return nnx.merge(block_def, params)(x)

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
        apply={
            "embed": lambda p, tokens: nnx.merge(embed_def, p)(tokens),
            "block": jax.checkpoint(apply_block) if cfg.remat else apply_block,
            "head": lambda p, x: nnx.merge(head_def, p)(x),
        },
        loss=cross_entropy,
        split=split,
        merge=merge,
        **family_functions(sys.modules[__name__], cfg),
        # q, k, v; gate, up and their product (silu(gate) is fused into the product)
        hints=PlannerHints(block_activation_width=(cfg.n_heads + 2 * cfg.kv_heads) * head_dim(cfg) + 3 * cfg.hidden),
        init_cache=lambda batch, max_len: init_cache(cfg, batch, max_len),
        decode=decode,
    )


def _staged_moe(cfg: ModelConfig, abstract: Llama) -> StagedModel:
    """The stage view with MoE blocks (models/moe_decoder.py)."""
    dense_width = (cfg.n_heads + 2 * cfg.kv_heads) * head_dim(cfg) + 3 * cfg.hidden
    width = max(dense_width, dense_width - 3 * cfg.hidden + moe_decoder.routed_width(cfg, 3))
    return moe_decoder.staged(cfg, abstract, sys.modules[__name__], width)


def param_count(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts: total, the part that enters matmuls (excludes the embedding and the norms), and of that the
    part one token's computation uses ('active': with MoE blocks, top_k experts of each)."""
    d, hidden, L, V = cfg.d_model, cfg.hidden, cfg.n_layers, cfg.vocab_size
    q_width, kv_width = cfg.n_heads * head_dim(cfg), cfg.kv_heads * head_dim(cfg)
    attention = d * q_width + 2 * d * kv_width + q_width * d  # q, k, v, o
    per_block_matmul = attention + 3 * d * hidden  # gate, up, down
    per_block_norms = 2 * d
    routed = moe_decoder.moe_layers(cfg)
    moe_matmul, moe_active = moe_decoder.matmul_params(cfg, attention, 3 * d * hidden)
    dense = L - routed
    return {
        "total": V * d + dense * per_block_matmul + routed * moe_matmul + L * per_block_norms + d + d * V,
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
