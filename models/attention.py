"""Attention shared by the model families: causal self-attention over a whole sequence, and the same attention
over a key/value cache for sampling (each new token costs one position, not the whole prefix).

Shapes follow `jax.nn.dot_product_attention`: q [B, T, H, D], k and v [B, S, K, D] with K dividing H (K < H is
grouped-query attention: each key/value head serves H / K query heads).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None = None) -> jax.Array:
    """Causal attention of a whole sequence (training and the no-cache reference): [B, T, H, D]. `segments`
    (int32 [B, T], documents packed into a row: models/documents.py): a position attends only to earlier
    positions of its own document."""
    if segments is None:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)
    t = q.shape[1]
    causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]  # [T, T]: query i sees keys 0 .. i
    same = segments[:, :, None] == segments[:, None, :]  # [B, T, T]
    return jax.nn.dot_product_attention(q, k, v, mask=(same & causal)[:, None])


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, cache_k: jax.Array, cache_v: jax.Array,
                     pos: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Attention of T new tokens at positions pos .. pos+T-1 over everything cached before them and themselves.

    cache_k, cache_v: [B, S, K, D] (S = the cache's capacity); the new keys and values are written at `pos` and
    the updated caches returned. Query i sees cached positions 0 .. pos+i only (causal; slots beyond are unused).
    With pos = 0 and T = the prompt length this is the prefill, equal to `causal_attention` of the prompt.
    """
    cache_k = jax.lax.dynamic_update_slice(cache_k, k.astype(cache_k.dtype), (0, pos, 0, 0))
    cache_v = jax.lax.dynamic_update_slice(cache_v, v.astype(cache_v.dtype), (0, pos, 0, 0))
    t, s = q.shape[1], cache_k.shape[1]
    visible = jnp.arange(s)[None, :] <= (pos + jnp.arange(t))[:, None]  # [T, S]
    out = jax.nn.dot_product_attention(q, cache_k.astype(q.dtype), cache_v.astype(q.dtype),
                                       mask=visible[None, None])
    return out, cache_k, cache_v
