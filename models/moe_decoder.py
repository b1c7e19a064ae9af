"""How mixture-of-experts blocks sit in a decoder (GPT, Llama): which blocks route, what flows between stages, the
loss with the auxiliary terms, and the stage view's pieces that differ from a dense decoder's.

With model.moe.experts > 0, block j has an MoE MLP when (j + 1) % moe.every == 0 (every block when every is 1;
Switch's every other block when it is 2), a dense MLP otherwise. The two kinds of block have different parameters,
so the whole model stacks them apart, `blocks` (dense) and `moe_blocks` ([n_layers / every] each), and runs them
as n_layers / every groups of (every - 1 dense blocks, 1 MoE block), one scanned body per group.

What flows between stages is a `Stream`: the residual stream and, per row, the running sums of the MoE layers'
auxiliary losses and token-drop rates. The embedding starts both sums at 0, each MoE block adds its own, the head
passes them on next to the logits, and the loss adds the mean over rows of the auxiliary sum to the
cross-entropy. So the auxiliary terms reach the loss, and their gradients the router, in the whole model and in the
stage-by-stage engine alike, with nothing but pytrees crossing the stage boundaries. Dense models (experts 0) do not
use this module: their activations stay plain arrays.

Packed rows (instruction data with data.pack, `staged(..., embed_documents=...)`): the Stream also carries each
position's document (models/documents.py), which every block's attention reads, so a document attends only to
itself and its positions count from its own start, as in the dense decoders. Routing stays per row: the documents
of a row share each expert's slots (as a document shares them with the padding after it), so a document's outputs
are the ones it gets alone in a row only while no routing is dropped; the auxiliary losses, too, are the row's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from angel_jax.config import ModelConfig
from models import documents
from models.common import cross_entropy, family_functions, stage_key
from models.moe import capacity, exchange_values, is_expert_leaf, is_moe
from models.stages import PlannerHints, Stage, StagedModel

Params = dict


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Stream:
    """What an MoE decoder's stages pass on."""

    x: jax.Array
    """The residual stream [B, T, d] between blocks; after the head, the float32 logits [B, T, V]."""
    aux_loss: jax.Array
    """float32 [B]: per row, the sum of the auxiliary losses (weighted) of the MoE layers run so far."""
    drop_rate: jax.Array
    """float32 [B]: per row, the sum of the token-drop rates of the MoE layers run so far."""
    segments: jax.Array | None = None
    """Rows of packed documents: float32 [B, T], each position's document (models/documents.py `carried`), which
    the blocks' attention reads; None when each row is one sequence, and after the head (the loss needs none)."""


def moe_layers(cfg: ModelConfig) -> int:
    return routed_count(cfg, cfg.n_layers)


def routed_count(cfg: ModelConfig, blocks: int) -> int:
    """How many of `blocks` blocks have an MoE MLP (`is_moe`: every moe.every-th), counted without a loop: a
    config's size is computed before anything is built, however deep it is."""
    return blocks // cfg.moe.every if cfg.moe.experts > 0 else 0


def stages(cfg: ModelConfig) -> tuple[Stage, ...]:
    """embed, block.0 .. block.{n_layers-1} (kind 'moe_block' for MoE blocks, 'block' for dense ones), head."""
    blocks = tuple(Stage(f"block.{j}", "moe_block" if is_moe(cfg, j) else "block") for j in range(cfg.n_layers))
    return (Stage("embed", "embed"),) + blocks + (Stage("head", "head"),)


# ----------------------------------------------------------------------------------------- one stage at a time


def start(x: jax.Array, segments: jax.Array | None = None) -> Stream:
    """The embedding's output: no auxiliary loss or drops yet. `segments`: int32 [B, T] when the rows hold packed
    documents (`documents.segments_of`)."""
    zeros = jnp.zeros(x.shape[:1], jnp.float32)
    return Stream(x, zeros, zeros, None if segments is None else documents.carried(segments))


def segment_ids(s: Stream) -> jax.Array | None:
    """The int32 segments the blocks' attention reads (None: one sequence per row)."""
    return None if s.segments is None else documents.segment_ids(s.segments)


def through_dense(block: Any, s: Stream) -> Stream:
    """A dense block: `block(x, segments)`."""
    return Stream(block(s.x, segment_ids(s)), s.aux_loss, s.drop_rate, s.segments)


def through_moe(block: Any, s: Stream) -> Stream:
    """An MoE block: `block.routed(x, segments)` gives its output and its `MoEFigures`."""
    x, figures = block.routed(s.x, segment_ids(s))
    return Stream(x, s.aux_loss + figures.aux_loss, s.drop_rate + figures.drop_rate, s.segments)


def finish(head: Any, s: Stream) -> Stream:
    return Stream(head(s.x), s.aux_loss, s.drop_rate)


def loss(out: Stream, targets: jax.Array, count: jax.Array | float | None = None) -> jax.Array:
    """Next-token cross-entropy (over the scored targets, divided by `count`: `common.cross_entropy`) plus the mean
    over rows of the MoE layers' auxiliary losses."""
    return cross_entropy(out.x, targets, count) + jnp.mean(out.aux_loss)


def figures(cfg: ModelConfig) -> Callable[[Stream], dict[str, jax.Array]]:
    """The step figures of a Stream that went through every block (the model's output, or the head's input):
    moe/aux_loss, the auxiliary term of the loss (every MoE layer's, weighted), and moe/drop_rate, the share of
    routings dropped, averaged over the MoE layers. Means over every leading axis (rows, and micro-batches when
    they are stacked)."""
    layers = moe_layers(cfg)

    def of(s: Stream) -> dict[str, jax.Array]:
        return {"moe/aux_loss": jnp.mean(s.aux_loss), "moe/drop_rate": jnp.mean(s.drop_rate) / layers}

    return of


def stage_apply(cfg: ModelConfig, embed_def: nnx.GraphDef, block_def: nnx.GraphDef | None,
                moe_def: nnx.GraphDef, head_def: nnx.GraphDef,
                embed_documents: Callable[[Any, jax.Array, jax.Array], jax.Array] | None = None
                ) -> dict[str, Callable]:
    """kind -> (stage params, Stream or token ids) -> Stream. `embed_documents(embed, tokens, segments)`: rows of
    packed documents, embedded by the family's embedding module at their positions within their documents."""
    remat = jax.checkpoint if cfg.remat else (lambda f: f)
    apply = {
        "embed": embed_stage(embed_def, embed_documents),
        "moe_block": remat(lambda p, s: through_moe(nnx.merge(moe_def, p), s)),
        "head": lambda p, s: finish(nnx.merge(head_def, p), s),
    }
    if block_def is not None:
        apply["block"] = remat(lambda p, s: through_dense(nnx.merge(block_def, p), s))
    return apply


def embed_stage(embed_def: nnx.GraphDef, embed_documents: Callable[[Any, jax.Array, jax.Array], jax.Array] | None
                ) -> Callable[[Any, jax.Array], Stream]:
    """The embedding stage: token ids -> a Stream, with the rows' segments when `embed_documents` is given (the
    token ids hold the document starts, and no later stage sees them)."""
    if embed_documents is None:
        return lambda p, tokens: start(nnx.merge(embed_def, p)(tokens))

    def embed(p: Any, tokens: jax.Array) -> Stream:
        segments = documents.segments_of(tokens)
        return start(embed_documents(nnx.merge(embed_def, p), tokens, segments), segments)

    return embed


def matmul_params(cfg: ModelConfig, attention: int, expert: int) -> tuple[int, int]:
    """(all, active) matmul parameters of an MoE block whose attention has `attention` and each expert `expert`:
    all experts, and the top_k a token uses; both with the router."""
    router = cfg.d_model * cfg.moe.experts
    return attention + router + cfg.moe.experts * expert, attention + router + cfg.moe.top_k * expert


def routed_width(cfg: ModelConfig, hidden_arrays: int) -> int:
    """Values per token an MoE block's MLP holds at its peak (`PlannerHints.block_activation_width`): its expert
    slots per token (E x C / T, about capacity_factor x top_k) each with `hidden_arrays` hidden activations and its
    input and output, and the float32 dispatch and combine masks, E x C values each (counted twice: float32)."""
    t, moe = cfg.seq_len, cfg.moe
    c = capacity(t, moe.experts, moe.top_k, moe.capacity_factor)
    slots = moe.experts * c / t
    return math.ceil(slots * (hidden_arrays * cfg.hidden + 2 * cfg.d_model)) + 4 * moe.experts * c


# ------------------------------------------------------------------------------------------- the whole model


def block_keys(key: jax.Array, cfg: ModelConfig, stage_key: Callable) -> tuple[jax.Array | None, jax.Array]:
    """The stage keys of the dense blocks (None when there are none) and of the MoE blocks, in block order: block j
    draws from stage_key(key, 1 + j) whichever stack it is in."""
    dense = [1 + j for j in range(cfg.n_layers) if not is_moe(cfg, j)]
    routed = [1 + j for j in range(cfg.n_layers) if is_moe(cfg, j)]

    def keys(ids: list[int]) -> jax.Array:
        return jax.vmap(lambda i: stage_key(key, i))(jnp.asarray(ids, dtype=jnp.uint32))

    return (keys(dense) if dense else None), keys(routed)


def add_blocks(model: nnx.Module, cfg: ModelConfig, key: jax.Array, block: Callable[..., nnx.Module]) -> None:
    """The decoder's blocks on `model`: `blocks` (dense) and, with experts, `moe_blocks`, each stacked on a leading
    axis by one construction vmapped over the per-block keys (`block(cfg, rngs, moe)`: the family's block)."""
    def stacked(keys: jax.Array, moe: bool = False) -> nnx.Module:
        return nnx.vmap(lambda k: block(cfg, nnx.Rngs(params=k), moe), in_axes=0, out_axes=0)(keys)

    if cfg.moe.experts:  # dense and MoE blocks stacked apart
        dense_keys, moe_keys = block_keys(key, cfg, stage_key)
        if dense_keys is not None:
            model.blocks = stacked(dense_keys)
        model.moe_blocks = stacked(moe_keys, moe=True)
    else:
        layers = jnp.arange(1, cfg.n_layers + 1, dtype=jnp.uint32)
        model.blocks = stacked(jax.vmap(lambda i: stage_key(key, i))(layers))


def decoder_stage(cfg: ModelConfig, embed: Callable, block: Callable, head: Callable
                  ) -> Callable[[int, nnx.Rngs], nnx.Module]:
    """How a decoder family (GPT, Llama) builds its stage `stage` alone (`common.one_stage_params`): the embedding,
    block j at stage 1 + j (with experts where `is_moe` says), the head."""
    def build(stage: int, rngs: nnx.Rngs) -> nnx.Module:
        if stage == 0:
            return embed(cfg, rngs)
        if stage <= cfg.n_layers:
            return block(cfg, rngs, moe=is_moe(cfg, stage - 1))
        return head(cfg, rngs)

    return build


def staged(cfg: ModelConfig, abstract: nnx.Module, family: Any, block_activation_width: int,
           embed_documents: Callable[[Any, jax.Array, jax.Array], jax.Array] | None = None) -> StagedModel:
    """The stage view of a decoder with MoE blocks (stages pass a `Stream` on; `decoder` samples). `abstract`: the model
    built abstractly (its `embed`, `blocks` if any, `moe_blocks`, `head`); `family`: its module, whose `init`,
    `init_stage`, `abstract_params`, `param_count` and `flops_per_token` take the config. `embed_documents(embed,
    tokens, segments)`: the rows hold packed documents (models/documents.py), embedded so; the whole model from
    `init` then keeps them apart too (the family's `documents`)."""
    block_def = nnx.graphdef(abstract.blocks) if hasattr(abstract, "blocks") else None
    return StagedModel(
        stages=stages(cfg),
        apply=stage_apply(cfg, nnx.graphdef(abstract.embed), block_def, nnx.graphdef(abstract.moe_blocks),
                          nnx.graphdef(abstract.head), embed_documents),
        loss=loss,
        split=lambda params: split(cfg, params),
        merge=lambda stage_params: merge(cfg, stage_params),
        **family_functions(family, cfg, embed_documents is not None),
        hints=PlannerHints(block_activation_width=block_activation_width,
                           exchange_values_per_row={"moe_block": float(exchange_values(cfg, cfg.seq_len))}),
        figures=figures(cfg),
        init_cache=lambda batch, max_len: family.init_cache(cfg, batch, max_len),
        decode=decoder(cfg, nnx.graphdef(abstract.embed), block_def, nnx.graphdef(abstract.moe_blocks),
                       nnx.graphdef(abstract.head), family.embed_at),
        expert_leaf=is_expert_leaf,
    )


def decoder(cfg: ModelConfig, embed_def: nnx.GraphDef, block_def: nnx.GraphDef | None, moe_def: nnx.GraphDef,
            head_def: nnx.GraphDef, embed_at: Callable) -> Callable:
    """`StagedModel.decode` of a decoder with MoE blocks: the family's cache ([n_layers, ...] keys and values, in
    block order), its blocks' `decode` and `routed_decode` (experts routing without drops), its `embed_at(embed,
    tokens, pos)`; the groups of `run_blocks` scanned, each with its blocks' slices of the cache."""
    every, groups = cfg.moe.every, cfg.n_layers // cfg.moe.every

    def decode(params: Params, cache: Params, tokens: jax.Array, pos: jax.Array) -> tuple[jax.Array, Params]:
        pos = jnp.asarray(pos, jnp.int32)
        x = embed_at(nnx.merge(embed_def, params["embed"]), tokens, pos)
        dense = grouped(params.get("blocks"), groups, every)
        per_group = {k: c.reshape(groups, every, *c.shape[1:]) for k, c in cache.items()}

        def body(h: jax.Array, group: tuple) -> tuple[jax.Array, dict]:
            dense_g, moe_g, cache_g = group
            ks, vs = [], []
            for i in range(every - 1):
                block = nnx.merge(block_def, jax.tree.map(lambda a, i=i: a[i], dense_g))
                h, k, v = block.decode(h, cache_g["k"][i], cache_g["v"][i], pos)
                ks.append(k)
                vs.append(v)
            h, k, v = nnx.merge(moe_def, moe_g).routed_decode(h, cache_g["k"][-1], cache_g["v"][-1], pos)
            return h, {"k": jnp.stack(ks + [k]), "v": jnp.stack(vs + [v])}

        x, new = jax.lax.scan(body, x, (dense, params["moe_blocks"], per_group))
        return nnx.merge(head_def, params["head"])(x), {k: c.reshape(cache[k].shape) for k, c in new.items()}

    return decode


def run_blocks(cfg: ModelConfig, block_def: nnx.GraphDef | None, dense: Any, moe_def: nnx.GraphDef, routed: Any,
               s: Stream) -> Stream:
    """The stacked blocks in order: n_layers / every groups of (every - 1 dense blocks, one MoE block), scanned
    (one compiled body) or unrolled as model.scan_blocks says; `dense` is None when every is 1."""
    every = cfg.moe.every

    def body(s: Stream, group: tuple) -> tuple[Stream, None]:
        dense_g, moe_g = group
        for i in range(every - 1):
            s = through_dense(nnx.merge(block_def, jax.tree.map(lambda a, i=i: a[i], dense_g)), s)
        return through_moe(nnx.merge(moe_def, moe_g), s), None

    return scan_groups(cfg, cfg.n_layers, body, s, dense, routed)


def scan_groups(cfg: ModelConfig, n: int, body: Callable[[Any, tuple], tuple[Any, None]], carry: Any, dense: Any,
                routed: Any) -> Any:
    """Thread `carry` through the n / every groups of `n` stacked blocks, `body(carry, (dense group, MoE block))`
    each: rematerialised as model.remat says, scanned (one compiled body) or unrolled as model.scan_blocks says.
    `dense`: the dense blocks stacked [n - n / every, ...] (None when every is 1); `routed`: the MoE blocks."""
    if cfg.remat:
        body = jax.checkpoint(body)
    groups = n // cfg.moe.every
    dense = grouped(dense, groups, cfg.moe.every)
    if cfg.scan_blocks:
        return jax.lax.scan(body, carry, (dense, routed))[0]
    for g in range(groups):
        carry = body(carry, jax.tree.map(lambda a, g=g: a[g], (dense, routed)))[0]
    return carry


def grouped(dense: Any, groups: int, every: int) -> Any:
    """Dense blocks stacked [groups x (every - 1), ...] as [groups, every - 1, ...] (None stays None)."""
    if dense is None:
        return None
    return jax.tree.map(lambda a: a.reshape(groups, every - 1, *a.shape[1:]), dense)


def split(cfg: ModelConfig, params: Params) -> list[Params]:
    """Whole-model params ({embed, [blocks], moe_blocks, head}) -> one pytree per stage."""
    out, taken = [params["embed"]], {"blocks": 0, "moe_blocks": 0}
    for j in range(cfg.n_layers):
        stack = "moe_blocks" if is_moe(cfg, j) else "blocks"
        out.append(jax.tree.map(lambda a, i=taken[stack]: a[i], params[stack]))
        taken[stack] += 1
    return out + [params["head"]]


def merge(cfg: ModelConfig, stage_params: list[Params]) -> Params:
    """Inverse of `split`."""
    embed, *blocks, head = stage_params
    out = {"embed": embed, "head": head}
    for stack, moe in (("blocks", False), ("moe_blocks", True)):
        members = [b for j, b in enumerate(blocks) if is_moe(cfg, j) == moe]
        if members:
            out[stack] = jax.tree.map(lambda *xs: jnp.stack(xs), *members)
    return out
