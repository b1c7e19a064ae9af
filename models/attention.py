"""Attention shared by the model families: causal self-attention over a whole sequence, and the same attention
over a key/value cache for sampling (each new token costs one position, not the whole prefix).

Shapes follow `jax.nn.dot_product_attention`: q [B, T, H, D], k and v [B, S, K, D] with K dividing H (K < H is
grouped-query attention: each key/value head serves H / K query heads). `cpu_fp32` (model.cpu_matmul_fp32): on the
CPU backend a bfloat16 attention computes in float32 and returns bfloat16 (models/common.py `fp32_here`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.common import fp32_here


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, cpu_fp32: bool, **kwargs) -> jax.Array:
    """`jax.nn.dot_product_attention(q, k, v, **kwargs)`, in float32 where `cpu_fp32` and `fp32_here(q.dtype)`:
    its two einsums are bfloat16 dots XLA:CPU runs slowly, like the layers' (models/common.py `dot_general`); the
    result in q's dtype."""
    if not (cpu_fp32 and fp32_here(q.dtype)):
        return jax.nn.dot_product_attention(q, k, v, **kwargs)
    up = (x.astype(jnp.float32) for x in (q, k, v))
    return jax.nn.dot_product_attention(*up, **kwargs).astype(q.dtype)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None = None, *,
                     cpu_fp32: bool) -> jax.Array:
    """Causal attention of a whole sequence (training and the no-cache reference): [B, T, H, D]. `segments`
    (int32 [B, T], documents packed into a row: models/documents.py): a position attends only to earlier
    positions of its own document."""
    if segments is None:
        return attention(q, k, v, is_causal=True, cpu_fp32=cpu_fp32)
    t = q.shape[1]
    causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]  # [T, T]: query i sees keys 0 .. i
    same = segments[:, :, None] == segments[:, None, :]  # [B, T, T]
    return attention(q, k, v, mask=(same & causal)[:, None], cpu_fp32=cpu_fp32)


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, cache_k: jax.Array, cache_v: jax.Array,
                     pos: jax.Array, *, cpu_fp32: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Attention of T new tokens at positions pos .. pos+T-1 over everything cached before them and themselves.

    cache_k, cache_v: [B, S, K, D] (S = the cache's capacity); the new keys and values are written at `pos` and
    the updated caches returned. Query i sees cached positions 0 .. pos+i only (causal; slots beyond are unused).
    With pos = 0 and T = the prompt length this is the prefill, equal to `causal_attention` of the prompt.
    """
    cache_k = jax.lax.dynamic_update_slice(cache_k, k.astype(cache_k.dtype), (0, pos, 0, 0))
    cache_v = jax.lax.dynamic_update_slice(cache_v, v.astype(cache_v.dtype), (0, pos, 0, 0))
    t, s = q.shape[1], cache_k.shape[1]
    visible = jnp.arange(s)[None, :] <= (pos + jnp.arange(t))[:, None]  # [T, S]
    out = attention(q, cache_k.astype(q.dtype), cache_v.astype(q.dtype), mask=visible[None, None],
                    cpu_fp32=cpu_fp32)
    return out, cache_k, cache_v
