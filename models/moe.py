"""A mixture-of-experts MLP in Flax NNX (GShard / Switch style), for the GPT, Llama and T5 blocks.

    moe = MoE(cfg, gated=False, out_std=..., rngs=rngs)   # model.moe: experts, top_k, capacity_factor, ...
    y, figures = moe(h)                                   # h [B, T, d] -> y [B, T, d]; figures per row [B]

A router (a linear map to the experts, softmax in float32) picks each token's top_k experts. Every sequence is a
routing group of its own (GShard's groups): each expert has `capacity` slots per sequence; a sequence's first
choices take slots before its second choices, tokens in order, and routings past an expert's last slot are dropped:
the expert does not see the token, and a token dropped by all of its experts gets 0 from the layer (the block's
residual carries it on). Dispatch and combine are einsums with one-hot [B, T, E, C] masks, so every shape is static
and the layer jits as one program. The experts' weights are stacked, [E, d, h] and [E, h, d]: a GELU MLP (GPT), a
gated SwiGLU MLP (Llama) or a gated-GELU MLP (T5), without biases.

Per row the layer also gives its auxiliary loss, aux_loss_coef x load balance + z_loss_coef x router z-loss, and
its token-drop rate (see `route`). Routing is per sequence, so every figure is per row: a batch split into
micro-batches or over devices by rows routes exactly as the whole batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from angel_jax.config import ModelConfig
from models import parallel
from models.common import einsum

_INIT_STD = 0.02


def is_moe(cfg: ModelConfig, block: int) -> bool:
    """Whether block `block` (0-based, of a decoder, or of T5's encoder or decoder) has an MoE MLP: every
    `moe.every`-th block when the model has experts."""
    return cfg.moe.experts > 0 and (block + 1) % cfg.moe.every == 0


def capacity(tokens: int, experts: int, top_k: int, factor: float) -> int:
    """Slots per expert in a group of `tokens`: `factor` x an even share of the group's routings, at least 1 and at
    most `tokens` (an expert never gets a token twice, so more slots than tokens would stay empty)."""
    return max(1, min(tokens, math.ceil(factor * tokens * top_k / experts)))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Routing:
    """How one layer routes a batch: masks [B, T, E, C] and figures per row [B] (float32)."""

    dispatch: jax.Array
    """1 where token t takes slot c of expert e, else 0."""
    combine: jax.Array
    """The dispatch mask weighted by the token's gate for that expert."""
    balance: jax.Array
    """Load-balancing loss E x sum_e f_e p_e: f_e the share of the row's routings (top_k per token, before capacity)
    that go to expert e, p_e the router probability of e averaged over the row's tokens. 1 when balanced."""
    z_loss: jax.Array
    """Router z-loss: the mean over the row's tokens of logsumexp(router logits)^2."""
    drop_rate: jax.Array
    """Share of the row's routings (tokens x top_k) that found their expert full."""


def route(logits: jax.Array, top_k: int, slots: int) -> Routing:
    """Route tokens by their router logits [B, T, E] (float32) to their top_k experts, `slots` per expert and row.

    Gates: the top_k softmax probabilities, renormalised to sum to 1 when top_k > 1 (with top_k = 1 the gate is the
    probability itself, so the router still gets a gradient through it). Priority for slots: every token's first
    choice before any token's second, tokens in sequence order within a choice."""
    b, t, e = logits.shape
    probs = jax.nn.softmax(logits, axis=-1)
    gates, experts = jax.lax.top_k(probs, top_k)  # [B, T, k]
    if top_k > 1:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    choice = jax.nn.one_hot(experts, e, dtype=jnp.int32)  # [B, T, k, E]
    by_priority = choice.transpose(0, 2, 1, 3).reshape(b, top_k * t, e)  # choice-major: [B, k x T, E]
    taken = jnp.cumsum(by_priority, axis=1).reshape(b, top_k, t, e).transpose(0, 2, 1, 3)  # slots used so far
    position = jnp.sum((taken - 1) * choice, axis=-1)  # [B, T, k]: the routing's slot in its expert
    kept = position < slots
    slot = jax.nn.one_hot(position, slots, dtype=jnp.float32) * kept[..., None]  # [B, T, k, C]
    chosen = choice.astype(jnp.float32)
    dispatch = jnp.einsum("btke,btkc->btec", chosen, slot)
    combine = jnp.einsum("btke,btkc->btec", chosen * gates[..., None], slot)
    share = jnp.mean(jnp.sum(chosen, axis=2), axis=1) / top_k  # [B, E]
    balance = e * jnp.sum(share * jnp.mean(probs, axis=1), axis=-1)
    z_loss = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2, axis=-1)
    drop_rate = jnp.mean((~kept).astype(jnp.float32), axis=(1, 2))
    return Routing(dispatch, combine, balance, z_loss, drop_rate)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class MoEFigures:
    """What one MoE layer adds to the training figures, per row [B] (float32)."""

    aux_loss: jax.Array
    """aux_loss_coef x load balance + z_loss_coef x router z-loss: the layer's term of the loss."""
    drop_rate: jax.Array
    """The layer's token-drop rate (`Routing.drop_rate`)."""


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, gated: bool, out_std: float, rngs: nnx.Rngs, gate_gelu: bool = False):
        """`gated`: SwiGLU experts (gate, up, down) instead of GELU ones (in, out); `out_std`: the init scale of
        the experts' output projections (the family's residual scaling); `gate_gelu`: gated experts with GELU in
        place of SiLU on the gate (T5 v1.1's gated-GELU MLP, models/t5.py)."""
        moe, d, h = cfg.moe, cfg.d_model, cfg.hidden
        pdt = jnp.dtype(cfg.param_dtype)
        self.compute_dtype = jnp.dtype(cfg.compute_dtype)
        self.experts, self.top_k, self.capacity_factor = moe.experts, moe.top_k, moe.capacity_factor
        self.aux_loss_coef, self.z_loss_coef, self.gated = moe.aux_loss_coef, moe.z_loss_coef, gated
        self.gate_gelu = gate_gelu
        self.cpu_fp32 = cfg.cpu_matmul_fp32
        init, out_init = nnx.initializers.normal(_INIT_STD), nnx.initializers.normal(out_std)
        # The router in float32 whatever the compute dtype: its softmax decides where tokens go.
        self.router = nnx.Linear(d, moe.experts, use_bias=False, dtype=jnp.float32, param_dtype=pdt,
                                 kernel_init=init, rngs=rngs)
        e = moe.experts
        if gated:
            self.gate = nnx.Param(init(rngs.params(), (e, d, h), pdt))
            self.up = nnx.Param(init(rngs.params(), (e, d, h), pdt))
            self.down = nnx.Param(out_init(rngs.params(), (e, h, d), pdt))
        else:
            self.w_in = nnx.Param(init(rngs.params(), (e, d, h), pdt))
            self.w_out = nnx.Param(out_init(rngs.params(), (e, h, d), pdt))

    def __call__(self, x: jax.Array, drop: bool = True) -> tuple[jax.Array, MoEFigures]:
        """x [B, T, d] (the block's normalised stream) -> (the experts' output [B, T, d], the layer's figures).
        `drop=False`: every expert has a slot for every token, so none is dropped (sampling: a prompt and the
        tokens after it are routed alike however they are cut into calls)."""
        cdt = self.compute_dtype
        slots = capacity(x.shape[1], self.experts, self.top_k, self.capacity_factor) if drop else x.shape[1]
        routing = route(self.router(x.astype(jnp.float32)), self.top_k, slots)
        expert_in = self._einsum("btec,btd->becd", routing.dispatch, x)  # [B, E, C, d]
        axis, mesh, weights = parallel.expert_axis(), parallel.expert_mesh(), self._weights()
        split = dict(mesh.shape).get(axis, 1) if mesh is not None else 1  # devices the experts split over
        if axis is not None and mesh is not None and split > 1 and self.experts % split == 0:
            # A whole-program jit over `mesh` (the in-memory engine): the exchange mapped over it, each device with
            # its rows of the batch and its E/N experts (the weights laid out so, train/sharding.py).
            rows, own = P(tuple(mesh.axis_names)), P(axis)
            out = jax.shard_map(lambda x, *w: self._exchanged(axis, x, w), mesh=mesh,
                                in_specs=(rows,) + (own,) * len(weights), out_specs=rows)(expert_in, *weights)
        elif axis is not None and mesh is None and weights[0].shape[0] < self.experts:
            out = self._exchanged(axis, expert_in, weights)  # already mapped: these weights are E/N experts
        else:
            out = self._experts(expert_in, weights)
        # Combined in float32: the gates weigh the experts' outputs at full precision.
        y = jnp.einsum("btec,becd->btd", routing.combine, out.astype(jnp.float32)).astype(cdt)
        aux = self.aux_loss_coef * routing.balance + self.z_loss_coef * routing.z_loss
        return y, MoEFigures(aux, routing.drop_rate)

    def _weights(self) -> tuple[jax.Array, ...]:
        return (self.gate[...], self.up[...], self.down[...]) if self.gated else (self.w_in[...], self.w_out[...])

    def _exchanged(self, axis: str, expert_in: jax.Array, weights: tuple[jax.Array, ...]) -> jax.Array:
        """Expert parallelism, on one device of the axis `axis` (inside a mapped function): this device holds
        experts [r x E/N, (r + 1) x E/N) of the E, device r of the axis. Each device's slots of expert e go to the
        device holding e, whose experts then run on every device's tokens; the outputs go back the same way.
        [B, E, C, d] -> [N x B, E/N, C, d] (rows of device 0 first) -> the experts -> [B, E, C, d]."""
        expert_in = jax.lax.all_to_all(expert_in, axis, split_axis=1, concat_axis=0, tiled=True)
        return jax.lax.all_to_all(self._experts(expert_in, weights), axis, split_axis=0, concat_axis=1, tiled=True)

    def _experts(self, expert_in: jax.Array, weights: tuple[jax.Array, ...]) -> jax.Array:
        """[B, E', C, d] -> [B, E', C, d]: expert e of `weights` (the E' experts held) on the slots of expert e."""
        if self.gated:
            gate_w, up_w, down_w = weights
            gate = self._einsum("becd,edh->bech", expert_in, gate_w)
            up = self._einsum("becd,edh->bech", expert_in, up_w)
            act = jax.nn.gelu(gate) if self.gate_gelu else jax.nn.silu(gate)
            return self._einsum("bech,ehd->becd", act * up, down_w)
        w_in, w_out = weights
        hidden = jax.nn.gelu(self._einsum("becd,edh->bech", expert_in, w_in))
        return self._einsum("bech,ehd->becd", hidden, w_out)

    def _einsum(self, spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
        """x against w in the compute dtype, under the families' matmul rule (models/common.py `einsum`: in float32
        on the CPU backend, the weights as stored)."""
        return einsum(spec, x, w, dtype=self.compute_dtype, cpu_fp32=self.cpu_fp32)


def exchange_values(cfg: ModelConfig, tokens: int) -> int:
    """Values one row of `tokens` tokens sends through one MoE layer's forward with the experts split over devices
    (`MoE.__call__`): its slots of every expert, E x capacity x d_model, out to the experts and their outputs back.
    A device keeps the share of its own experts: the all-to-alls move (N - 1) / N of it."""
    moe = cfg.moe
    return 2 * moe.experts * capacity(tokens, moe.experts, moe.top_k, moe.capacity_factor) * cfg.d_model


EXPERT_WEIGHTS = ("w_in", "w_out", "gate", "up", "down")
"""The names of an `MoE`'s stacked expert weights, [E, ...] each."""


def is_expert_leaf(path: str) -> bool:
    """Whether the leaf at `path` (`jax.tree_util.keystr` of its path in a stage's parameters or in optimizer state
    shaped like them) is an MoE layer's stacked expert weight: its last key is one of `EXPERT_WEIGHTS`. (Dense
    layers' weights end in 'kernel', 'bias', 'scale' or 'embedding', never in these.)"""
    return any(path.endswith(f"['{name}']") for name in EXPERT_WEIGHTS)
