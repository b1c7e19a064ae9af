"""A 16-bit weight's matmul on XLA:CPU: 16-bit operands, products summed in float32, in the forward and in both
of its backward dots.

XLA:CPU runs a bfloat16 dot fast only in some layouts and only when asked for a float32 result
(`preferred_element_type`). Measured on the 2-core AVX-512/AMX VM for [128, 2048] x [2048, 8192]
(experiments/bench/bf16_cpu.py has the whole block):

    x @ w         float32 38 ms CPU   bfloat16 -> float32 12 ms    bfloat16 -> bfloat16 12 ms
    g @ w.T       float32 36 ms       bfloat16 -> float32 10.5 ms  bfloat16 -> bfloat16 73 ms
    x.T @ g       float32 57 ms       bfloat16 -> float32 63 ms    bfloat16 -> bfloat16 80 ms

JAX's own transpose rules differentiate `dot_general(..., preferred_element_type=float32)` with dots whose result
is the operand's dtype (the slow bfloat16 -> bfloat16 row), and upcasting a 16-bit weight to use the float32 dot
is a pass over the weight (20 ms for this one) in the forward, again in a remat's recompute and around its
gradient. So the product here has its own VJP: every dot in bfloat16 with a float32 result, each result rounded
once to its operand's dtype. Products of bfloat16 numbers are exact in float32, so this is the float32 dot of the
same operands up to the order of the sums.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_F32 = jnp.float32


@jax.custom_vjp
def matmul_f32(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x @ w` for `x` [..., K] and `w` [K, N] of one 16-bit dtype, summed and returned in float32."""
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=_F32)


def _forward(x: jax.Array, w: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return matmul_f32(x, w), (x, w)


def _backward(saved: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, w = saved
    g = g.astype(w.dtype)  # the cotangent of a result rounded to the compute dtype: exact where it came from one
    dx = jax.lax.dot_general(g, w, (((g.ndim - 1,), (1,)), ((), ())), preferred_element_type=_F32)
    batch = tuple(range(x.ndim - 1))
    dw = jax.lax.dot_general(x, g, ((batch, batch), ((), ())), preferred_element_type=_F32)
    return dx.astype(x.dtype), dw.astype(w.dtype)


matmul_f32.defvjp(_forward, _backward)


def applies(x_dtype: jnp.dtype, w_dtype: jnp.dtype) -> bool:
    """Whether `matmul_f32` computes this product: activations and weight of one float dtype narrower than
    float32 (a float32 weight keeps the float32 dot: rounding it first would be a pass over it)."""
    x_dtype, w_dtype = jnp.dtype(x_dtype), jnp.dtype(w_dtype)
    return x_dtype == w_dtype and jnp.issubdtype(w_dtype, jnp.floating) and jnp.finfo(w_dtype).bits < 32
