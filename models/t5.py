"""A T5 v1.1 encoder-decoder in Flax NNX, trained with span corruption (models/span_corruption.py).

T5 v1.1 (Raffel et al. 2020; the v1.1 checkpoints' changes): pre-norm blocks with RMSNorm (a scale, no mean, no
bias), a gated-GELU MLP (gelu(x W0) * (x W1) W_out), no bias terms anywhere, relative position biases instead of
position embeddings (bucketed relative distances; bidirectional in the encoder, causal in the decoder; cross
attention has none), decoder blocks that attend to the encoder's output, one token embedding shared by encoder and
decoder inputs, and an untied output projection. Compute in `compute_dtype` over `param_dtype` parameters, as the
other families. Attention is scaled by 1/sqrt(head_dim) and the weights are drawn as the GPT's (normal, std 0.02;
residual projections by 1/sqrt(2 x depth)), not with T5's unscaled attention and its matching initialiser.

Stages, in forward order (the stage view is a chain whose activations are pairs):

    embed              tokens -> (encoder x, decoder x): corrupts the row and embeds both id sequences
    encoder.0 .. L-1   (x, decoder x) -> (block(x), decoder x)
    encoder_norm       (x, decoder x) -> (decoder x, encoder output = norm(x))
    decoder.0 .. L'-1  (y, encoder output) -> (block(y, encoder output), encoder output)
    head               (y, encoder output) -> logits of the decoder's positions

The decoder's input rides along through the encoder stages and the encoder's output through the decoder stages,
passed on unchanged, so every stage has one input and one output and the paged executor saves and passes them as
any activation. Backward through a decoder stage (`jax.vjp`) adds that stage's cross-attention gradient to the
encoder output's gradient it receives and passes the sum on: the gradient of the encoder output is accumulated
from every decoder stage by construction, and reaches `encoder_norm` whole.

Relative position bias: each self-attention layer owns its table (relative_buckets x n_heads), where T5 shares one
per stack (owned by its first layer). Per-layer tables keep the blocks of a stack identical in structure, so one
jitted forward and backward serves the stack, and nothing but the two activations crosses a stage boundary
(carrying a shared bias instead would add an n_heads x T x T activation to every stage); they cost
relative_buckets x n_heads parameters a layer.

The objective: `loss(logits, targets)` rebuilds the decoder's target from `targets = row[:, 1:]` with the corruption
the embed stage applied to `tokens = row[:, :-1]` (the same deterministic mask, models/span_corruption.py), and
takes the mean cross-entropy over the decoder's positions (no padding: the corruption's lengths are fixed).
`model.vocab_size` is the tokenizer's (it must cover its ids, as for every family); the embedding table and the
logits have `spans + 1` more ids above them, the sentinels and the decoder's start id (`SpanCorruption.table_size`).

Mixture of experts (model.moe.experts > 0; the T5-MoE of GShard / Switch): encoder block j and decoder block j
have a mixture of gated-GELU experts (models/moe.py) in place of the MLP when (j + 1) % moe.every == 0. Such blocks
are stacked apart (`encoder_moe`, `decoder_moe`; dense ones stay in `encoder`, `decoder`) and are stages of the
kinds 'encoder_moe' and 'decoder_moe'. Their auxiliary losses reach the loss as moe_decoder's `Stream` carries
them: every activation between stages gets two more members, per row the running sums of the MoE layers'
auxiliary losses and token-drop rates ((x, decoder x, aux, drops) through the encoder, (y, encoder output, aux,
drops) through the decoder), and the head returns a `moe_decoder.Stream` of the logits and both sums, whose mean
auxiliary sum the loss adds to the cross-entropy. A dense T5 (experts 0) passes pairs as before.

Random keys: stage i draws from `fold_in(key(seed), i)` alone (0 = embed, 1 + j = encoder block j, L + 1 =
encoder_norm, L + 2 + j = decoder block j, L + L' + 2 = head), so `init_stage` gives a stage bit-identical to the
whole model's. No sampling: `init_cache` and `decode` are None.
"""

from __future__ import annotations

from typing import Any

import sys

import jax
import jax.numpy as jnp
from flax import nnx

from angel_jax.config import ConfigError, ModelConfig
from models import moe_decoder
from models.attention import attention
from models.common import (Linear, abstract_params_of, cross_entropy, family_functions, one_stage_params,
                           stage_key, whole_params)
from models.moe import MoE, MoEFigures, exchange_values, is_expert_leaf, is_moe
from models.span_corruption import SpanCorruption
from models.stages import PlannerHints, Stage, StagedModel

_INIT_STD = 0.02

Params = dict
"""Model parameters as a plain nested dict of arrays (`nnx.to_pure_dict(state)`)."""

Pair = tuple[jax.Array, jax.Array]
"""The activation between stages: (the stream the stage transforms, the one it passes on unchanged)."""


def _dtypes(cfg: ModelConfig) -> tuple[jnp.dtype, jnp.dtype]:
    return jnp.dtype(cfg.compute_dtype), jnp.dtype(cfg.param_dtype)


def corruption(cfg: ModelConfig) -> SpanCorruption:
    return SpanCorruption(cfg.seq_len, cfg.vocab_size)


# -------------------------------------------------------------------------------------- relative positions


def relative_bucket(relative: jax.Array, bidirectional: bool, buckets: int, max_distance: int) -> jax.Array:
    """T5's bucket of each relative position (key position - query position): half the buckets (of a side, when
    bidirectional) are exact distances 0, 1, ...; the others grow logarithmically up to `max_distance`, beyond
    which distances share the last bucket. Causal: keys after the query (masked anyway) share bucket 0."""
    n = -relative
    base = jnp.zeros_like(relative)
    if bidirectional:
        buckets //= 2
        base = jnp.where(n < 0, buckets, 0)
        n = jnp.abs(n)
    else:
        n = jnp.maximum(n, 0)
    exact = buckets // 2
    far = exact + (jnp.log(jnp.maximum(n, 1).astype(jnp.float32) / exact) / jnp.log(max_distance / exact)
                   * (buckets - exact)).astype(jnp.int32)
    return base + jnp.where(n < exact, n, jnp.minimum(far, buckets - 1))


class RelativeBias(nnx.Module):
    """A layer's learned bias per (head, relative-position bucket), added to its attention logits."""

    def __init__(self, cfg: ModelConfig, bidirectional: bool, rngs: nnx.Rngs):
        _, pdt = _dtypes(cfg)
        self.table = nnx.Param(nnx.initializers.normal(_INIT_STD)(rngs.params(), (cfg.relative_buckets, cfg.n_heads),
                                                                  pdt))
        self.bidirectional, self.max_distance = bidirectional, cfg.relative_max_distance

    def __call__(self, length: int, dtype: jnp.dtype) -> jax.Array:
        """[1, n_heads, length, length]: the bias of query i and key j."""
        positions = jnp.arange(length)
        buckets = relative_bucket(positions[None, :] - positions[:, None], self.bidirectional,
                                  self.table.shape[0], self.max_distance)
        return self.table[...][buckets].transpose(2, 0, 1)[None].astype(dtype)


# ---------------------------------------------------------------------------------------------- layers


class Attention(nnx.Module):
    """Multi-head attention without biases: self-attention (`context` None) or attention to `context`."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        cdt, pdt = _dtypes(cfg)
        d = cfg.d_model
        lin = dict(use_bias=False, dtype=cdt, param_dtype=pdt, cpu_fp32=cfg.cpu_matmul_fp32, rngs=rngs)
        init = nnx.initializers.normal(_INIT_STD)
        depth = cfg.n_layers + cfg.decoder_layers
        self.q = Linear(d, d, kernel_init=init, **lin)
        self.k = Linear(d, d, kernel_init=init, **lin)
        self.v = Linear(d, d, kernel_init=init, **lin)
        self.o = Linear(d, d, kernel_init=nnx.initializers.normal(_INIT_STD / (2 * depth) ** 0.5), **lin)
        self.n_heads = cfg.n_heads
        self.cpu_fp32 = cfg.cpu_matmul_fp32

    def __call__(self, x: jax.Array, context: jax.Array | None = None, bias: jax.Array | None = None,
                 causal: bool = False) -> jax.Array:
        context = x if context is None else context
        b, t, d = x.shape
        heads = (self.n_heads, d // self.n_heads)
        q = self.q(x).reshape(b, t, *heads)
        k = self.k(context).reshape(b, context.shape[1], *heads)
        v = self.v(context).reshape(b, context.shape[1], *heads)
        out = attention(q, k, v, bias=bias, is_causal=causal, cpu_fp32=self.cpu_fp32)
        return self.o(out.reshape(b, t, d))


class GatedGelu(nnx.Module):
    """T5 v1.1's MLP: (gelu(x W0) * x W1) W_out."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        cdt, pdt = _dtypes(cfg)
        d, hidden = cfg.d_model, cfg.hidden
        lin = dict(use_bias=False, dtype=cdt, param_dtype=pdt, cpu_fp32=cfg.cpu_matmul_fp32, rngs=rngs)
        init = nnx.initializers.normal(_INIT_STD)
        depth = cfg.n_layers + cfg.decoder_layers
        self.gate = Linear(d, hidden, kernel_init=init, **lin)
        self.up = Linear(d, hidden, kernel_init=init, **lin)
        self.down = Linear(hidden, d, kernel_init=nnx.initializers.normal(_INIT_STD / (2 * depth) ** 0.5), **lin)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.gelu(self.gate(x)) * self.up(x))


def _norm(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.RMSNorm:
    cdt, pdt = _dtypes(cfg)
    return nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, dtype=cdt, param_dtype=pdt, rngs=rngs)


class Embed(nnx.Module):
    """The corruption of the row and the token embedding shared by the encoder's and the decoder's inputs."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        cdt, pdt = _dtypes(cfg)
        self.corruption = corruption(cfg)
        self.tokens = nnx.Embed(self.corruption.table_size, cfg.d_model, dtype=cdt, param_dtype=pdt,
                                embedding_init=nnx.initializers.normal(_INIT_STD), rngs=rngs)

    def __call__(self, tokens: jax.Array) -> Pair:
        c = self.corruption
        mask = c.noise_mask(tokens)
        decoder_ids = c.decoder_input(c.decoder_target(tokens, mask))
        return self.tokens(c.encoder_input(tokens, mask)), self.tokens(decoder_ids)


def _mlp(cfg: ModelConfig, rngs: nnx.Rngs, moe: bool) -> nnx.Module:
    """The dense gated-GELU MLP, or (`moe`) a mixture of gated-GELU experts with the same residual scaling."""
    if not moe:
        return GatedGelu(cfg, rngs)
    depth = cfg.n_layers + cfg.decoder_layers
    return MoE(cfg, gated=True, gate_gelu=True, out_std=_INIT_STD / (2 * depth) ** 0.5, rngs=rngs)


class EncoderBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, moe: bool = False):
        """`moe`: a mixture of experts in place of the MLP; call the block with `routed`."""
        self.attn_norm = _norm(cfg, rngs)
        self.attn = Attention(cfg, rngs)
        self.position_bias = RelativeBias(cfg, bidirectional=True, rngs=rngs)
        self.mlp_norm = _norm(cfg, rngs)
        self.mlp = _mlp(cfg, rngs, moe)

    def _attend(self, x: jax.Array) -> jax.Array:
        return x + self.attn(self.attn_norm(x), bias=self.position_bias(x.shape[1], x.dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self._attend(x)
        return x + self.mlp(self.mlp_norm(x))

    def routed(self, x: jax.Array) -> tuple[jax.Array, MoEFigures]:
        """An MoE block's forward: its output and its MoE layer's figures."""
        x = self._attend(x)
        y, figures = self.mlp(self.mlp_norm(x))
        return x + y, figures


class DecoderBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, moe: bool = False):
        """`moe`: a mixture of experts in place of the MLP; call the block with `routed`."""
        self.self_norm = _norm(cfg, rngs)
        self.self_attn = Attention(cfg, rngs)
        self.position_bias = RelativeBias(cfg, bidirectional=False, rngs=rngs)
        self.cross_norm = _norm(cfg, rngs)
        self.cross_attn = Attention(cfg, rngs)
        self.mlp_norm = _norm(cfg, rngs)
        self.mlp = _mlp(cfg, rngs, moe)

    def _attend(self, y: jax.Array, encoded: jax.Array) -> jax.Array:
        y = y + self.self_attn(self.self_norm(y), bias=self.position_bias(y.shape[1], y.dtype), causal=True)
        return y + self.cross_attn(self.cross_norm(y), context=encoded)

    def __call__(self, y: jax.Array, encoded: jax.Array) -> jax.Array:
        y = self._attend(y, encoded)
        return y + self.mlp(self.mlp_norm(y))

    def routed(self, y: jax.Array, encoded: jax.Array) -> tuple[jax.Array, MoEFigures]:
        y = self._attend(y, encoded)
        out, figures = self.mlp(self.mlp_norm(y))
        return y + out, figures


class Head(nnx.Module):
    """The decoder's final norm and the (untied) output projection."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        cdt, pdt = _dtypes(cfg)
        self.norm = _norm(cfg, rngs)
        self.unembed = Linear(cfg.d_model, corruption(cfg).table_size, use_bias=False, dtype=cdt,
                                  param_dtype=pdt, kernel_init=nnx.initializers.normal(_INIT_STD),
                                  cpu_fp32=cfg.cpu_matmul_fp32, rngs=rngs)

    def __call__(self, y: jax.Array) -> jax.Array:
        return self.unembed(self.norm(y)).astype(jnp.float32)


def _stacked(cls: type, cfg: ModelConfig, key: jax.Array, first: int, n: int) -> nnx.Module:
    """n blocks of `cls` on a leading axis, block j drawn from stage key `first + j`."""

    @nnx.vmap(in_axes=0, out_axes=0)
    def make(block_key: jax.Array) -> nnx.Module:
        return cls(cfg, nnx.Rngs(params=block_key))

    return make(jax.vmap(lambda i: stage_key(key, i))(jnp.arange(first, first + n, dtype=jnp.uint32)))


def _stacked_blocks(cls: type, cfg: ModelConfig, key: jax.Array, first: int, stage_ids: list[int],
                    moe: bool) -> nnx.Module:
    """Blocks of `cls` on a leading axis, one per stage index in `stage_ids` (drawn from that stage's key)."""

    @nnx.vmap(in_axes=0, out_axes=0)
    def make(block_key: jax.Array) -> nnx.Module:
        return cls(cfg, nnx.Rngs(params=block_key), moe)

    return make(jax.vmap(lambda i: stage_key(key, i))(jnp.asarray(stage_ids, dtype=jnp.uint32)))


def moe_layers(cfg: ModelConfig) -> int:
    """MoE MLPs in the encoder and the decoder together."""
    return moe_decoder.routed_count(cfg, cfg.n_layers) + moe_decoder.routed_count(cfg, cfg.decoder_layers)


Carry = tuple
"""An MoE T5's activation between blocks: (the stream a block transforms, the per-row auxiliary sum, the per-row
drop-rate sum) inside the whole model; the stages add the passed-on stream as the second member."""


def _zeros_per_row(x: jax.Array) -> jax.Array:
    return jnp.zeros(x.shape[:1], jnp.float32)


class T5(nnx.Module):
    def __init__(self, cfg: ModelConfig, key: jax.Array):
        """`key`: the model's base key (`jax.random.key(seed)`); each stage uses only `stage_key(key, i)`."""
        n_enc, n_dec = cfg.n_layers, cfg.decoder_layers
        self.cfg = cfg
        self.embed = Embed(cfg, nnx.Rngs(params=stage_key(key, 0)))
        if cfg.moe.experts:  # dense and MoE blocks stacked apart, each drawn from its own stage's key
            stacks = (("encoder", EncoderBlock, 1, n_enc), ("decoder", DecoderBlock, n_enc + 2, n_dec))
            for name, cls, first, n in stacks:
                dense = [first + j for j in range(n) if not is_moe(cfg, j)]
                routed = [first + j for j in range(n) if is_moe(cfg, j)]
                if dense:
                    setattr(self, name, _stacked_blocks(cls, cfg, key, first, dense, False))
                setattr(self, name + "_moe", _stacked_blocks(cls, cfg, key, first, routed, True))
        else:
            self.encoder = _stacked(EncoderBlock, cfg, key, 1, n_enc)
            self.decoder = _stacked(DecoderBlock, cfg, key, n_enc + 2, n_dec)
        self.encoder_norm = _norm(cfg, nnx.Rngs(params=stage_key(key, n_enc + 1)))
        self.head = Head(cfg, nnx.Rngs(params=stage_key(key, n_enc + n_dec + 2)))

    def __call__(self, tokens: jax.Array) -> jax.Array | moe_decoder.Stream:
        """Logits; with MoE blocks, a `moe_decoder.Stream` of the logits and the auxiliary sums."""
        if self.cfg.moe.experts:
            return self._routed(tokens)
        x, y = self.embed(tokens)
        enc_def, enc_state = nnx.split(self.encoder)
        x = _scan(lambda h, p: nnx.merge(enc_def, p)(h), x, enc_state, self.cfg)
        encoded = self.encoder_norm(x)
        dec_def, dec_state = nnx.split(self.decoder)
        y = _scan(lambda h, p: nnx.merge(dec_def, p)(h, encoded), y, dec_state, self.cfg)
        return self.head(y)

    def _routed(self, tokens: jax.Array) -> moe_decoder.Stream:
        cfg = self.cfg
        x, y = self.embed(tokens)

        def stacks(name: str) -> tuple:
            dense = getattr(self, name, None)
            dense_def, dense_state = nnx.split(dense) if dense is not None else (None, None)
            return (dense_def, dense_state) + nnx.split(getattr(self, name + "_moe"))

        x, aux, drops = _run_groups(cfg, cfg.n_layers, *stacks("encoder"), (x, _zeros_per_row(x), _zeros_per_row(x)),
                                    ())
        encoded = self.encoder_norm(x)
        y, aux, drops = _run_groups(cfg, cfg.decoder_layers, *stacks("decoder"), (y, aux, drops), (encoded,))
        return moe_decoder.Stream(self.head(y), aux, drops)


def _through_dense(block: Any, s: Carry, context: tuple) -> Carry:
    return (block(s[0], *context),) + tuple(s[1:])


def _through_moe(block: Any, s: Carry, context: tuple) -> Carry:
    """An MoE block on a carry whose last two members are the per-row auxiliary and drop-rate sums."""
    h, figures = block.routed(s[0], *context)
    return (h,) + tuple(s[1:-2]) + (s[-2] + figures.aux_loss, s[-1] + figures.drop_rate)


def _run_groups(cfg: ModelConfig, n: int, dense_def: nnx.GraphDef | None, dense: Any, moe_def: nnx.GraphDef,
                routed: Any, s: Carry, context: tuple) -> Carry:
    """`n` stacked blocks in order: n / every groups of (every - 1 dense blocks, one MoE block), scanned (one
    compiled body) or unrolled as model.scan_blocks says; `dense` is None when every is 1. `context`: the extra
    arguments of every block (the decoder's: the encoder output)."""
    every = cfg.moe.every

    def body(s: Carry, group: tuple) -> tuple[Carry, None]:
        dense_g, moe_g = group
        for i in range(every - 1):
            s = _through_dense(nnx.merge(dense_def, jax.tree.map(lambda a, i=i: a[i], dense_g)), s, context)
        return _through_moe(nnx.merge(moe_def, moe_g), s, context), None

    return moe_decoder.scan_groups(cfg, n, body, s, dense, routed)


def _scan(block: Any, x: jax.Array, stacked: Any, cfg: ModelConfig) -> jax.Array:
    """Apply the stacked blocks in order, scanned (one compiled body) or unrolled."""

    def body(h: jax.Array, params: Params) -> tuple[jax.Array, None]:
        return block(h, params), None

    if cfg.remat:
        body = jax.checkpoint(body)
    if cfg.scan_blocks:
        return jax.lax.scan(body, x, stacked)[0]
    for i in range(jax.tree.leaves(stacked)[0].shape[0]):
        x = body(x, jax.tree.map(lambda a: a[i], stacked))[0]
    return x


# ------------------------------------------------------------------------------------------ init and stages


def check(cfg: ModelConfig) -> None:
    """What this family needs beyond ModelConfig's own checks."""
    if cfg.seq_len < 2:
        raise ConfigError(f"'model.seq_len': span corruption needs at least 2 positions, got {cfg.seq_len}")
    if cfg.moe.experts and cfg.decoder_layers % cfg.moe.every:
        raise ConfigError(f"'model.moe.every': the decoder's {cfg.decoder_layers} blocks (model.n_decoder_layers) "
                          f"are not a multiple of moe.every={cfg.moe.every}")


def init(cfg: ModelConfig, seed: int) -> tuple[nnx.GraphDef, Params]:
    """Build the model and return (graphdef, params). Only nnx.Param state exists in this model."""
    return whole_params(T5, cfg, seed)


def init_stage(cfg: ModelConfig, seed: int, stage: int) -> Params:
    """Stage `stage`'s params alone, equal bit for bit to `staged(cfg).split(init(cfg, seed)[1])[stage]`; only that
    stage's arrays are created."""
    n_enc, n_dec = cfg.n_layers, cfg.decoder_layers

    def build(stage: int, rngs: nnx.Rngs) -> nnx.Module:
        if stage == 0:
            return Embed(cfg, rngs)
        if stage <= n_enc:
            return EncoderBlock(cfg, rngs, is_moe(cfg, stage - 1))
        if stage == n_enc + 1:
            return _norm(cfg, rngs)
        if stage <= n_enc + n_dec + 1:
            return DecoderBlock(cfg, rngs, is_moe(cfg, stage - n_enc - 2))
        return Head(cfg, rngs)

    return one_stage_params(seed, stage, n_enc + n_dec + 3, build)


def abstract_params(cfg: ModelConfig) -> tuple[nnx.GraphDef, Params]:
    """(graphdef, params as jax.ShapeDtypeStruct) without allocating anything."""
    return abstract_params_of(T5, cfg)


def loss(cfg: ModelConfig):
    """(logits [B, decoder_length, table_size], targets = row[:, 1:]) -> the mean cross-entropy of the decoder's target,
    rebuilt from `targets` (its positions 0 .. seq_len-2 are the row's 1 .. seq_len-1, all the corruption reads)."""
    c = corruption(cfg)

    def span_loss(logits: jax.Array, targets: jax.Array, count: jax.Array | float | None = None) -> jax.Array:
        # `count` is unused: the decoder's targets are computed here, every one of them scored (instruction data,
        # whose marks would say otherwise, is refused for T5: data.format), so equal pieces of a batch have equal
        # counts and their mean losses average to the batch's.
        text = jnp.pad(targets[:, :-1], ((0, 0), (1, 0)))  # position 0 is never noise: its value is not used
        return cross_entropy(logits, c.decoder_target(text, c.noise_mask(text)))

    return span_loss


def staged(cfg: ModelConfig) -> StagedModel:
    """The stage view: embed, the encoder blocks, encoder_norm, the decoder blocks, head."""
    check(cfg)
    if cfg.moe.experts:
        return _staged_moe(cfg)
    n_enc, n_dec = cfg.n_layers, cfg.decoder_layers
    abstract = nnx.eval_shape(lambda: T5(cfg, jax.random.key(0)))
    embed_def, enc_def, norm_def, dec_def, head_def = (
        nnx.graphdef(m) for m in (abstract.embed, abstract.encoder, abstract.encoder_norm, abstract.decoder,
                                  abstract.head))

    def apply_encoder(params: Params, xy: Pair) -> Pair:
        x, y = xy
        return nnx.merge(enc_def, params)(x), y

    def apply_encoder_norm(params: Params, xy: Pair) -> Pair:
        x, y = xy
        return y, nnx.merge(norm_def, params)(x)

    def apply_decoder(params: Params, ye: Pair) -> Pair:
        y, encoded = ye
        return nnx.merge(dec_def, params)(y, encoded), encoded

    def split(params: Params) -> list[Params]:
        def blocks(stacked: Params, n: int) -> list[Params]:
            return [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(n)]

        return ([params["embed"]] + blocks(params["encoder"], n_enc) + [params["encoder_norm"]]
                + blocks(params["decoder"], n_dec) + [params["head"]])

    def merge(stage_params: list[Params]) -> Params:
        def stack(blocks: list[Params]) -> Params:
            return jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)

        return {"embed": stage_params[0], "encoder": stack(stage_params[1:n_enc + 1]),
                "encoder_norm": stage_params[n_enc + 1], "decoder": stack(stage_params[n_enc + 2:-1]),
                "head": stage_params[-1]}

    def maybe_remat(fn: Any) -> Any:
        return jax.checkpoint(fn) if cfg.remat else fn

    c = corruption(cfg)
    d, hidden = cfg.d_model, cfg.hidden
    stages = ((Stage("embed", "embed"),) + tuple(Stage(f"encoder.{i}", "encoder") for i in range(n_enc))
              + (Stage("encoder_norm", "encoder_norm"),)
              + tuple(Stage(f"decoder.{i}", "decoder") for i in range(n_dec)) + (Stage("head", "head"),))
    forward = forward_flops_per_row(cfg)
    return StagedModel(
        stages=stages,
        apply={
            "embed": lambda p, tokens: nnx.merge(embed_def, p)(tokens),
            "encoder": maybe_remat(apply_encoder),
            "encoder_norm": apply_encoder_norm,
            "decoder": maybe_remat(apply_decoder),
            "head": lambda p, ye: nnx.merge(head_def, p)(ye[0]),
        },
        loss=loss(cfg),
        split=split,
        merge=merge,
        **family_functions(sys.modules[__name__], cfg),
        hints=PlannerHints(
            # a decoder block's peak: its q, k, v (self-attention), the cross-attention's q and the encoder output's
            # k and v (counted per decoder position: an over-estimate, the encoder is the longer), the MLP's gate,
            # up and their product
            block_activation_width=6 * d + 3 * hidden,
            # every stage after the first holds both streams, the encoder's and the decoder's positions d_model
            # wide (its own copy of the passed-on one: a jitted stage returns a new buffer for an input it returns
            # unchanged)
            saved_input_values=(n_enc + n_dec + 2) * (c.encoder_length + c.decoder_length) * d,
            forward_flops_per_row=forward),
    )


def _kind_stacks(cfg: ModelConfig) -> list[tuple[str, str]]:
    """An MoE T5's block stages in order: (kind, whole-model stack) of each encoder then decoder block."""
    return ([("encoder_moe", "encoder_moe") if is_moe(cfg, j) else ("encoder", "encoder") for j in range(cfg.n_layers)]
            + [("decoder_moe", "decoder_moe") if is_moe(cfg, j) else ("decoder", "decoder")
               for j in range(cfg.decoder_layers)])


def figures(cfg: ModelConfig) -> Any:
    """The step figures of an MoE T5 (moe/aux_loss: the loss's auxiliary term; moe/drop_rate: the share of routings
    dropped, averaged over the encoder's and the decoder's MoE layers), from the model's output (a
    `moe_decoder.Stream`) or the head's input ((y, encoder output, aux sums, drop sums)): both carry the sums."""
    layers = moe_layers(cfg)

    def of(s: Any) -> dict[str, jax.Array]:
        aux, drops = (s.aux_loss, s.drop_rate) if isinstance(s, moe_decoder.Stream) else s[-2:]
        return {"moe/aux_loss": jnp.mean(aux), "moe/drop_rate": jnp.mean(drops) / layers}

    return of


def _staged_moe(cfg: ModelConfig) -> StagedModel:
    """The stage view of an MoE T5: the dense one's stages, MoE blocks of the kinds 'encoder_moe' and 'decoder_moe',
    every activation carrying the per-row auxiliary and drop-rate sums as its last two members."""
    n_enc, n_dec = cfg.n_layers, cfg.decoder_layers
    abstract = nnx.eval_shape(lambda: T5(cfg, jax.random.key(0)))
    names = ("embed", "encoder", "encoder_moe", "encoder_norm", "decoder", "decoder_moe", "head")
    defs = {name: nnx.graphdef(getattr(abstract, name)) for name in names if hasattr(abstract, name)}
    kinds = _kind_stacks(cfg)
    span_loss = loss(cfg)

    def embed(p: Params, tokens: jax.Array) -> Carry:
        x, y = nnx.merge(defs["embed"], p)(tokens)
        return x, y, _zeros_per_row(x), _zeros_per_row(x)

    def encoder(kind: str) -> Any:
        through = _through_moe if kind.endswith("_moe") else _through_dense
        return lambda p, s: through(nnx.merge(defs[kind], p), s, ())

    def decoder(kind: str) -> Any:
        through = _through_moe if kind.endswith("_moe") else _through_dense
        return lambda p, s: through(nnx.merge(defs[kind], p), s, (s[1],))

    def encoder_norm(p: Params, s: Carry) -> Carry:
        x, y, aux, drops = s
        return y, nnx.merge(defs["encoder_norm"], p)(x), aux, drops

    def head(p: Params, s: Carry) -> moe_decoder.Stream:
        return moe_decoder.Stream(nnx.merge(defs["head"], p)(s[0]), s[2], s[3])

    def moe_loss(out: moe_decoder.Stream, targets: jax.Array, count: jax.Array | float | None = None) -> jax.Array:
        return span_loss(out.x, targets) + jnp.mean(out.aux_loss)

    def split(params: Params) -> list[Params]:
        out, taken = [params["embed"]], {}
        for j, (_, stack) in enumerate(kinds):
            out.append(jax.tree.map(lambda a, i=taken.get(stack, 0): a[i], params[stack]))
            taken[stack] = taken.get(stack, 0) + 1
            if j == n_enc - 1:
                out.append(params["encoder_norm"])
        return out + [params["head"]]

    def merge(stage_params: list[Params]) -> Params:
        blocks = stage_params[1:n_enc + 1] + stage_params[n_enc + 2:-1]
        out = {"embed": stage_params[0], "encoder_norm": stage_params[n_enc + 1], "head": stage_params[-1]}
        for stack in ("encoder", "encoder_moe", "decoder", "decoder_moe"):
            members = [b for b, (_, s) in zip(blocks, kinds) if s == stack]
            if members:
                out[stack] = jax.tree.map(lambda *xs: jnp.stack(xs), *members)
        return out

    remat = jax.checkpoint if cfg.remat else (lambda f: f)
    apply = {"embed": embed, "encoder_norm": encoder_norm, "head": head}
    for kind in {k for k, _ in kinds}:
        apply[kind] = remat(encoder(kind) if kind.startswith("encoder") else decoder(kind))
    stages = ((Stage("embed", "embed"),)
              + tuple(Stage(f"encoder.{j}", kinds[j][0]) for j in range(n_enc))
              + (Stage("encoder_norm", "encoder_norm"),)
              + tuple(Stage(f"decoder.{j}", kinds[n_enc + j][0]) for j in range(n_dec)) + (Stage("head", "head"),))
    c = corruption(cfg)
    d, hidden = cfg.d_model, cfg.hidden
    return StagedModel(
        stages=stages,
        apply=apply,
        loss=moe_loss,
        split=split,
        merge=merge,
        **family_functions(sys.modules[__name__], cfg),
        hints=PlannerHints(
            # the dense decoder block's peak, or the MoE block's attention inputs and its routed MLP (three hidden
            # arrays per slot: gate, up and their product)
            block_activation_width=max(6 * d + 3 * hidden, 6 * d + moe_decoder.routed_width(cfg, 3)),
            # as the dense T5's, and the two per-row sums
            saved_input_values=(n_enc + n_dec + 2) * ((c.encoder_length + c.decoder_length) * d + 2),
            forward_flops_per_row=forward_flops_per_row(cfg),
            exchange_values_per_row={"encoder_moe": float(exchange_values(cfg, c.encoder_length)),
                                     "decoder_moe": float(exchange_values(cfg, c.decoder_length))}),
        figures=figures(cfg),
        expert_leaf=is_expert_leaf,
    )


def param_count(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts: total, and the part that enters matmuls (excludes the embedding, the norms and the
    relative position biases); with MoE blocks also 'active', the matmul parameters one token uses (top_k experts
    of each MoE MLP, and its router)."""
    d, hidden, V = cfg.d_model, cfg.hidden, corruption(cfg).table_size
    attn, mlp, bias = 4 * d * d, 3 * d * hidden, cfg.relative_buckets * cfg.n_heads
    moe = cfg.moe
    routed = moe_layers(cfg)  # arithmetic: the size of a config is known before anything is built
    encoder = attn + mlp
    decoder = 2 * attn + mlp
    # an MoE MLP in place of a dense one: the router and `experts` copies of the MLP (all, or top_k: active)
    extra = routed * (d * moe.experts + (moe.experts - 1) * mlp)
    counts = {
        "total": V * d + cfg.n_layers * (encoder + bias + 2 * d) + d
                 + cfg.decoder_layers * (decoder + bias + 3 * d) + d + d * V + extra,
        "matmul": cfg.n_layers * encoder + cfg.decoder_layers * decoder + d * V + extra,
    }
    if moe.experts:
        counts["active"] = counts["matmul"] - extra + routed * (d * moe.experts + (moe.top_k - 1) * mlp)
    return counts


def forward_flops_per_row(cfg: ModelConfig) -> dict[str, float]:
    """Stage kind -> forward FLOPs of one stage of that kind on one row: 2 per weight per position it is applied
    to (the encoder's positions for the encoder blocks and the cross-attention's k and v; the decoder's for the
    rest), attention's QK^T and AV over the full square (4 x positions x keys x d_model), an embedding lookup's
    d_model per id and a norm's. What `angel-jax plan --estimate` times the stages by."""
    c = corruption(cfg)
    d, hidden, V = cfg.d_model, cfg.hidden, c.table_size
    enc, dec = c.encoder_length, c.decoder_length
    flops = {
        "embed": float((enc + dec) * d),
        "encoder": 2.0 * enc * (4 * d * d + 3 * d * hidden) + 4.0 * enc * enc * d,
        "encoder_norm": float(enc * d),
        "decoder": (2.0 * dec * (6 * d * d + 3 * d * hidden) + 2.0 * enc * 2 * d * d
                    + 4.0 * dec * dec * d + 4.0 * dec * enc * d),
        "head": 2.0 * dec * d * V,
    }
    if cfg.moe.experts:  # an MoE block: its router and the top_k experts a token goes to, in place of the MLP
        routed = 2.0 * (d * cfg.moe.experts + (cfg.moe.top_k - 1) * 3 * d * hidden)
        flops["encoder_moe"] = flops["encoder"] + enc * routed
        flops["decoder_moe"] = flops["decoder"] + dec * routed
    return flops


def flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token of the row (seq_len tokens: what tokens/s counts), forward + backward: 3 x the
    forward FLOPs of the blocks and the head on one row (`forward_flops_per_row`; 6N per position plus attention,
    as the PaLM formula counts the GPT's), over seq_len. Model FLOPs: no recompute; lookups and norms are left out."""
    f = forward_flops_per_row(cfg)
    per_row = f["head"] + sum(f[kind] for kind, _ in _kind_stacks(cfg))
    return 3.0 * per_row / cfg.seq_len
