"""Documents packed into one row (instruction data with `data.pack: true`): each attends only to itself, and its
positions count from its own start, as if it were alone in the row.

Where a document starts is carried in-band by its first token (angel_jax/data/marks.py `doc_starts`), so the
token ids alone give each position's document, its segment:

    segments = segments_of(tokens)     # int32 [B, T]: 0 before the first start, +1 at every start
    positions_in(segments)             # int32 [B, T]: the position's distance from its document's start
    causal_attention(q, k, v, segments) (models/attention.py) masks keys of other documents

A decoder built for packed rows (`models.get(cfg, documents=True)`) passes a `Packed` between its stages, the
residual stream with the segments, since a block sees no token ids; the embedding makes it from the tokens and
the head drops the segments. A decoder with mixture-of-experts blocks passes its `moe_decoder.Stream` instead,
which carries the segments next to its auxiliary sums (models/moe_decoder.py). Rows with one document each
(padding) need none of it: attention is causal and padding only follows a document.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp

from angel_jax.data import marks as token_marks


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Packed:
    """What a decoder's stages pass on when its rows hold packed documents."""

    x: jax.Array
    """The residual stream [B, T, d]."""
    segments: jax.Array
    """float32 [B, T]: the document of each position within its row (`segments_of`). float32 because the paged
    engine differentiates a stage with respect to all of its input (its gradient is zero, and has a place to go);
    the counts are exact up to 2**24 documents in a row."""

    def segment_ids(self) -> jax.Array:
        """The segments as int32 (what attention and positions read)."""
        return segment_ids(self.segments)


def carried(segments: jax.Array) -> jax.Array:
    """int32 segments (`segments_of`) as a stage passes them on: float32 (`Packed.segments` says why)."""
    return segments.astype(jnp.float32)


def segment_ids(segments: jax.Array) -> jax.Array:
    """Segments as a stage passed them on (`carried`) back to int32, with no gradient through them."""
    return jax.lax.stop_gradient(segments).astype(jnp.int32)


def segments_of(tokens: jax.Array) -> jax.Array:
    """int32 [B, T]: for each position, how many documents started at or before it in its row."""
    return jnp.cumsum(token_marks.doc_starts(tokens), axis=-1, dtype=jnp.int32)


def positions_in(segments: jax.Array) -> jax.Array:
    """int32 [B, T]: each position's distance from the first position of its segment."""
    t = jnp.arange(segments.shape[-1], dtype=jnp.int32)
    first = jnp.concatenate([jnp.ones_like(segments[:, :1], bool), segments[:, 1:] != segments[:, :-1]], axis=-1)
    return t - jax.lax.cummax(jnp.where(first, t, 0), axis=1)


def stage_apply(embed: Callable[[Any, jax.Array, jax.Array], jax.Array],
                block: Callable[[Any, jax.Array, jax.Array], jax.Array],
                head: Callable[[Any, jax.Array], Any]) -> dict[str, Callable]:
    """A dense decoder's stage functions over packed rows, from its `embed(params, tokens, segments)`,
    `block(params, x, segments)` and `head(params, x)`."""
    def embed_stage(p: Any, tokens: jax.Array) -> Packed:
        segments = segments_of(tokens)
        return Packed(embed(p, tokens, segments), carried(segments))

    return {"embed": embed_stage,
            "block": lambda p, s: Packed(block(p, s.x, s.segment_ids()), s.segments),
            "head": lambda p, s: head(p, s.x)}
