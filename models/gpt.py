"""A GPT decoder in Flax NNX: pre-norm blocks, causal attention, bf16 compute over fp32 parameters.

The blocks are created stacked (one leading axis of size n_layers, through `nnx.vmap`) so the whole model can run
them with one `jax.lax.scan` body, and so block i's parameters are simply `leaf[i]`. `staged()` exposes the same
computation as stages (embed, n_layers blocks, head) for the scheduling pass; `tests/test_model.py` checks that
running the stages in sequence gives the whole model's logits.

Random keys: stage i (0 = embed, 1 + j = block j, n_layers + 1 = head) draws its parameters from
`fold_in(key(seed), i)` alone, so one stage can be initialised by itself (`init_stage`, for models larger than host
RAM) with exactly the values the whole model gets; `tests/test_model_init.py` checks the two bit for bit.

Sampling (`decode`, `init_cache`): a key/value cache stacked like the blocks, [n_layers, B, S, n_heads, head_dim]
for keys and for values, so one scan runs every block on its own slice of the cache. `tests/test_decode.py` checks
that a prefill and single-token steps give the logits of the whole-sequence forward.

Instruction data (angel_jax/data/marks.py): the embedding reads token ids through their in-band marks and the loss
counts only the scored targets (models/common.py `cross_entropy`). Packed rows (`staged(cfg, documents=True)`):
the stages pass the documents' segments on with the stream, attention stays within a document and the learned
positions count from each document's start (models/documents.py), with MoE blocks as without.

Mixture of experts (model.moe.experts > 0): every moe.every-th block has a mixture of GELU experts
(models/moe.py) in place of its MLP; such blocks are stacked apart (`moe_blocks`), and the stages pass the
auxiliary losses on next to the residual stream (models/moe_decoder.py); it samples with the same cache, its
experts routing without drops (`moe_decoder.decoder`).
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from angel_jax.data import marks as token_marks
from angel_jax.config import ModelConfig
from models.attention import cached_attention, causal_attention
from models import documents as documents_lib, moe_decoder
from models.common import (Linear, abstract_params_of, cross_entropy, family_functions, one_stage_params,
                           stage_key, whole_params)
from models.moe import MoE, MoEFigures
from models.stages import PlannerHints, Stage, StagedModel

_INIT_STD = 0.02

Params = dict
"""Model parameters as a plain nested dict of arrays (`nnx.to_pure_dict(state)`): what optax, orbax and the page
layout see. `nnx.merge(graphdef, params)` turns it back into a module inside jit."""


def _dtypes(cfg: ModelConfig) -> tuple[jnp.dtype, jnp.dtype]:
    return jnp.dtype(cfg.compute_dtype), jnp.dtype(cfg.param_dtype)


class Embed(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        cdt, pdt = _dtypes(cfg)
        init = nnx.initializers.normal(_INIT_STD)
        self.tokens = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=cdt, param_dtype=pdt, embedding_init=init, rngs=rngs)
        self.positions = nnx.Param(init(rngs.params(), (cfg.seq_len, cfg.d_model), pdt))
        self.compute_dtype = cdt

    def __call__(self, tokens: jax.Array, segments: jax.Array | None = None) -> jax.Array:
        """Tokens [B, T] (ids with their in-band marks) at positions 0 .. T-1, or with `segments` (packed
        documents) at their positions within their documents."""
        if segments is None:
            pos = self.positions[...][: tokens.shape[-1]]
        else:
            pos = self.positions[...][documents_lib.positions_in(segments)]
        return self.tokens(token_marks.token_ids(tokens)) + pos.astype(self.compute_dtype)

    def at(self, tokens: jax.Array, start: jax.Array) -> jax.Array:
        """Tokens [B, T] at positions start .. start+T-1 (`start` may be traced; the caller keeps start+T within
        seq_len: a dynamic slice would silently clamp it)."""
        pos = jax.lax.dynamic_slice_in_dim(self.positions[...], start, tokens.shape[-1])
        return self.tokens(tokens) + pos.astype(self.compute_dtype)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, moe: bool = False):
        """`moe`: a mixture of experts (models/moe.py, model.moe) in place of the MLP; call it with `routed`."""
        cdt, pdt = _dtypes(cfg)
        d, hidden = cfg.d_model, cfg.hidden
        init = nnx.initializers.normal(_INIT_STD)
        # GPT-2: residual projections scaled by 1/sqrt(2 * depth) so the stream's variance does not grow with depth.
        out_init = nnx.initializers.normal(_INIT_STD / (2 * cfg.n_layers) ** 0.5)
        lin = dict(dtype=cdt, param_dtype=pdt, cpu_fp32=cfg.cpu_matmul_fp32, rngs=rngs)
        self.ln_attn = nnx.LayerNorm(d, epsilon=cfg.norm_eps, dtype=cdt, param_dtype=pdt, rngs=rngs)
        self.qkv = Linear(d, 3 * d, kernel_init=init, **lin)
        self.attn_out = Linear(d, d, kernel_init=out_init, **lin)
        self.ln_mlp = nnx.LayerNorm(d, epsilon=cfg.norm_eps, dtype=cdt, param_dtype=pdt, rngs=rngs)
        if moe:
            self.moe = MoE(cfg, gated=False, out_std=_INIT_STD / (2 * cfg.n_layers) ** 0.5, rngs=rngs)
        else:
            self.mlp_in = Linear(d, hidden, kernel_init=init, **lin)
            self.mlp_out = Linear(hidden, d, kernel_init=out_init, **lin)
        self.n_heads = cfg.n_heads
        self.cpu_fp32 = cfg.cpu_matmul_fp32

    def __call__(self, x: jax.Array, segments: jax.Array | None = None) -> jax.Array:
        """`segments`: packed documents (models/documents.py), each attending only to itself."""
        q, k, v = self._qkv(x)
        return self._residual(x, causal_attention(q, k, v, segments, cpu_fp32=self.cpu_fp32))

    def decode(self, x: jax.Array, cache_k: jax.Array, cache_v: jax.Array,
               pos: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The block on tokens at positions pos .. pos+T-1, attending to this block's cache [B, S, H, D] of the
        positions before them; returns the output and the cache with their keys and values added."""
        q, k, v = self._qkv(x)
        attn, cache_k, cache_v = cached_attention(q, k, v, cache_k, cache_v, pos, cpu_fp32=self.cpu_fp32)
        return self._residual(x, attn), cache_k, cache_v

    def _qkv(self, x: jax.Array) -> list[jax.Array]:
        b, t, d = x.shape
        return jnp.split(self.qkv(self.ln_attn(x)).reshape(b, t, 3 * self.n_heads, d // self.n_heads), 3, axis=2)

    def routed(self, x: jax.Array, segments: jax.Array | None = None) -> tuple[jax.Array, MoEFigures]:
        """An MoE block's forward: its output and its MoE layer's figures (`segments` as for `__call__`)."""
        q, k, v = self._qkv(x)
        x = self._attention_residual(x, causal_attention(q, k, v, segments, cpu_fp32=self.cpu_fp32))
        y, figures = self.moe(self.ln_mlp(x))
        return x + y, figures

    def routed_decode(self, x: jax.Array, cache_k: jax.Array, cache_v: jax.Array,
                      pos: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """An MoE block's `decode`: its experts route without dropping a token (`MoE.__call__(drop=False)`)."""
        q, k, v = self._qkv(x)
        attn, cache_k, cache_v = cached_attention(q, k, v, cache_k, cache_v, pos, cpu_fp32=self.cpu_fp32)
        x = self._attention_residual(x, attn)
        return x + self.moe(self.ln_mlp(x), drop=False)[0], cache_k, cache_v

    def _residual(self, x: jax.Array, attn: jax.Array) -> jax.Array:
        """Attention's projection and the MLP, each added to the residual stream."""
        x = self._attention_residual(x, attn)
        return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.ln_mlp(x))))

    def _attention_residual(self, x: jax.Array, attn: jax.Array) -> jax.Array:
        b, t, d = x.shape
        return x + self.attn_out(attn.reshape(b, t, d))


class Head(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        cdt, pdt = _dtypes(cfg)
        self.ln = nnx.LayerNorm(cfg.d_model, epsilon=cfg.norm_eps, dtype=cdt, param_dtype=pdt, rngs=rngs)
        self.unembed = Linear(cfg.d_model, cfg.vocab_size, use_bias=False, dtype=cdt, param_dtype=pdt,
                                  cpu_fp32=cfg.cpu_matmul_fp32,
                                  kernel_init=nnx.initializers.normal(_INIT_STD), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.unembed(self.ln(x)).astype(jnp.float32)


class GPT(nnx.Module):
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
        x = self.embed(tokens, segments)
        if self.cfg.moe.experts:
            block_def, block_state = nnx.split(self.blocks) if hasattr(self, "blocks") else (None, None)
            moe_def, moe_state = nnx.split(self.moe_blocks)
            s = moe_decoder.run_blocks(self.cfg, block_def, block_state, moe_def, moe_state,
                                       moe_decoder.start(x, segments))
            return moe_decoder.finish(self.head, s)
        block_def, block_state = nnx.split(self.blocks)
        x = run_blocks(block_def, block_state, x, scan=self.cfg.scan_blocks, remat=self.cfg.remat,
                       segments=segments)
        return self.head(x)


def run_blocks(block_def: nnx.GraphDef, stacked: nnx.State | Params, x: jax.Array, *, scan: bool, remat: bool,
               segments: jax.Array | None = None) -> jax.Array:
    """Apply the stacked blocks in order, scanned (one compiled body) or unrolled; `segments`: packed documents."""

    def body(h: jax.Array, params: Params) -> tuple[jax.Array, None]:
        return nnx.merge(block_def, params)(h, segments), None

    if remat:
        body = jax.checkpoint(body)
    if scan:
        return jax.lax.scan(body, x, stacked)[0]
    n = jax.tree.leaves(stacked)[0].shape[0]
    for i in range(n):
        x = body(x, jax.tree.map(lambda a: a[i], stacked))[0]
    return x


def init(cfg: ModelConfig, seed: int, documents: bool = False) -> tuple[nnx.GraphDef, Params]:
    """Build the model and return (graphdef, params). Only nnx.Param state exists in this model. `documents`: the
    graphdef runs rows of packed documents."""
    return whole_params(functools.partial(GPT, documents=documents), cfg, seed)


def init_stage(cfg: ModelConfig, seed: int, stage: int) -> Params:
    """Stage `stage`'s params alone (embed, block j = stage 1 + j, or head), equal bit for bit to
    `staged(cfg).split(init(cfg, seed)[1])[stage]`; only that stage's arrays are created."""
    return one_stage_params(seed, stage, cfg.n_layers + 2, moe_decoder.decoder_stage(cfg, Embed, Block, Head))


def abstract_params(cfg: ModelConfig, documents: bool = False) -> tuple[nnx.GraphDef, Params]:
    """(graphdef, params as jax.ShapeDtypeStruct) without allocating anything (`documents` as for `init`)."""
    return abstract_params_of(functools.partial(GPT, documents=documents), cfg)


def staged(cfg: ModelConfig, documents: bool = False) -> StagedModel:
    """The stage view of the model: embed, n_layers homogeneous blocks, head. `documents`: rows of packed
    documents (models/documents.py), a `Packed` between the stages."""
    abstract = nnx.eval_shape(lambda: GPT(cfg, jax.random.key(0)))
    if cfg.moe.experts:
        return _staged_moe(cfg, abstract, documents)
    embed_def = nnx.graphdef(abstract.embed)
    block_def = nnx.graphdef(abstract.blocks)
    head_def = nnx.graphdef(abstract.head)

    def apply_block(params: Params, x: jax.Array, segments: jax.Array | None = None) -> jax.Array:
        return nnx.merge(block_def, params)(x, segments)

    remat = jax.checkpoint if cfg.remat else (lambda f: f)
    if documents:
        apply = documents_lib.stage_apply(lambda p, tokens, segments: nnx.merge(embed_def, p)(tokens, segments),
                                          remat(apply_block), lambda p, x: nnx.merge(head_def, p)(x))
    else:
        apply = {"embed": lambda p, tokens: nnx.merge(embed_def, p)(tokens), "block": remat(apply_block),
                 "head": lambda p, x: nnx.merge(head_def, p)(x)}

    def split(params: Params) -> list[Params]:
        blocks = params["blocks"]
        return ([params["embed"]]
                + [jax.tree.map(lambda a, i=i: a[i], blocks) for i in range(cfg.n_layers)]
                + [params["head"]])

    def merge(stage_params: list[Params]) -> Params:
        embed, *blocks, head = stage_params
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)
        return {"embed": embed, "blocks": stacked, "head": head}

    def decode(params: Params, cache: Params, tokens: jax.Array, pos: jax.Array) -> tuple[jax.Array, Params]:
        x = nnx.merge(embed_def, params["embed"]).at(tokens, pos)

        def body(h: jax.Array, layer: tuple) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
            block, cache_k, cache_v = layer
            h, cache_k, cache_v = nnx.merge(block_def, block).decode(h, cache_k, cache_v, pos)
            return h, (cache_k, cache_v)

        x, (k, v) = jax.lax.scan(body, x, (params["blocks"], cache["k"], cache["v"]))
        return nnx.merge(head_def, params["head"])(x), {"k": k, "v": v}

    stages = (Stage("embed", "embed"),) + tuple(Stage(f"block.{i}", "block") for i in range(cfg.n_layers)) \
        + (Stage("head", "head"),)
    return StagedModel(
        stages=stages,
        apply=apply,
        loss=cross_entropy,
        split=split,
        merge=merge,
        **family_functions(sys.modules[__name__], cfg, documents),
        hints=PlannerHints(block_activation_width=3 * cfg.d_model + 2 * cfg.hidden),  # qkv, the MLP in and out
        init_cache=lambda batch, max_len: init_cache(cfg, batch, max_len),
        decode=decode,
    )


def init_cache(cfg: ModelConfig, batch: int, max_len: int) -> Params:
    """An empty key/value cache, [n_layers, batch, max_len, n_heads, head_dim] for keys and for values."""
    if not 0 < max_len <= cfg.seq_len:  # learned positions exist for 0 .. seq_len-1 only
        raise ValueError(f"a key/value cache of {max_len} positions: must be between 1 and the model's "
                         f"context, model.seq_len={cfg.seq_len}")
    shape = (cfg.n_layers, batch, max_len, cfg.n_heads, cfg.d_model // cfg.n_heads)
    return {"k": jnp.zeros(shape, cfg.compute_dtype), "v": jnp.zeros(shape, cfg.compute_dtype)}


def embed_at(embed: Embed, tokens: jax.Array, pos: jax.Array) -> jax.Array:
    """Tokens [B, T] at positions pos .. pos+T-1, embedded (learned positions)."""
    return embed.at(tokens, pos)


def _staged_moe(cfg: ModelConfig, abstract: GPT, documents: bool) -> StagedModel:
    """The stage view with MoE blocks (models/moe_decoder.py); `documents`: rows of packed documents, embedded at
    their learned positions within their documents."""
    width = max(3 * cfg.d_model + 2 * cfg.hidden, 3 * cfg.d_model + moe_decoder.routed_width(cfg, 2))
    embed_documents = (lambda embed, tokens, segments: embed(tokens, segments)) if documents else None
    return moe_decoder.staged(cfg, abstract, sys.modules[__name__], width, embed_documents)


def param_count(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts: total, the part that enters matmuls (excludes embeddings and norms), and of that the part
    one token's computation uses ('active': with MoE blocks, top_k experts of each)."""
    d, hidden, L, V = cfg.d_model, cfg.hidden, cfg.n_layers, cfg.vocab_size
    attention = d * 3 * d + d * d
    per_block_matmul = attention + d * hidden + hidden * d
    per_block_other = 3 * d + d + hidden + d + 4 * d  # biases and two LayerNorms
    embedding = V * d + cfg.seq_len * d
    head = 2 * d + d * V
    routed = moe_decoder.moe_layers(cfg)
    dense = L - routed
    # An MoE block: the router, experts without biases.
    moe_matmul, moe_active = moe_decoder.matmul_params(cfg, attention, 2 * d * hidden)
    moe_other = 3 * d + d + 4 * d
    return {
        "total": embedding + dense * (per_block_matmul + per_block_other) + routed * (moe_matmul + moe_other) + head,
        "matmul": dense * per_block_matmul + routed * moe_matmul + d * V,
        "active": dense * per_block_matmul + routed * moe_active + d * V,
    }


def flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token (forward + backward), the PaLM formula: 6 * N_matmul + 12 * L * d * T.

    N_matmul counts weights that enter matrix products (blocks and unembedding, not the embedding lookup);
    the second term is attention's QK^T and AV (counted for the full T x T square, as PaLM does). With MoE blocks
    N is `param_count`'s 'active': the router and the top_k experts a token is routed to (not the dispatch and
    combine einsums, nor slots left empty). With remat the hardware does ~8N instead of 6N; MFU is still stated
    against 6N ("model" FLOPs, not hardware FLOPs).
    """
    n = param_count(cfg)["active"]
    return 6.0 * n + 12.0 * cfg.n_layers * cfg.d_model * cfg.seq_len
