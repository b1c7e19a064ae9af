"""Pieces every model family shares: the per-stage random keys, the loss, the pure-dict view of NNX state, how
a family builds its parameters whole, abstractly or one stage at a time, and the matmul rule of the CPU backend
(`dot_general`, `einsum`, `Linear`)."""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from angel_jax.data import marks as token_marks
from models import cpu_dot


def fp32_here(compute_dtype: Any) -> bool:
    """Whether a matmul of a model computing in `compute_dtype` computes in float32 in the program being traced:
    the compute dtype is a float narrower than float32 (a bfloat16 recipe) and the program is for XLA:CPU. XLA:CPU
    has no fast bfloat16 dot for every layout: a weight gradient's dot (contracting the batch and sequence axes)
    runs a generic loop, so a bfloat16 block's forward and backward took 11x its float32 time on the 2-core VM
    (experiments/bench/bf16_cpu.py).

    Decided when the program is traced, from the default backend: the model's stage and step functions run there.
    (The paged engine's host updates run on the CPU backend of a GPU machine too, but they hold no model matmul.)"""
    dtype = jnp.dtype(compute_dtype)
    return jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32 and jax.default_backend() == "cpu"


def precision_line(cfg: Any) -> str:
    """The run's compute dtypes in one line for its start-up report, with the matmul rule where it applies
    ("compute bfloat16, parameters float32, matmuls in float32 on cpu: ...")."""
    line = f"compute {cfg.compute_dtype}, parameters {cfg.param_dtype}"
    if not fp32_here(cfg.compute_dtype):
        return line
    if cfg.cpu_matmul_fp32 and cpu_dot.applies(cfg.compute_dtype, cfg.param_dtype):
        return (f"{line}, matmuls {cfg.compute_dtype} with float32 sums on {jax.default_backend()}, forward and "
                "backward (XLA:CPU's fast path for them)")
    if cfg.cpu_matmul_fp32:
        return (f"{line}, matmuls in float32 on {jax.default_backend()}: XLA:CPU has no fast bfloat16 dot "
                "(model.cpu_matmul_fp32=false keeps them in bfloat16)")
    return f"{line}, matmuls in bfloat16 on {jax.default_backend()} (model.cpu_matmul_fp32=false: slow on XLA:CPU)"


def dot_general(x: jax.Array, w: jax.Array, dimension_numbers: Any, *, dtype: Any, cpu_fp32: bool) -> jax.Array:
    """The families' matmul rule: activations `x` against weights `w` (as stored, in model.param_dtype), the
    result in the compute dtype `dtype`. Where `cpu_fp32` (model.cpu_matmul_fp32) and `fp32_here(dtype)`: the
    activations rounded to `dtype` as everywhere else, then both operands in float32 (exact upcasts), products
    summed in float32, the result rounded to `dtype` once; so what is stored and moved around the dot (stage inputs,
    activations) stays in bfloat16 and the dot is XLA:CPU's float32 one. Weights are not rounded to bfloat16 first:
    on the CPU that rounding is a pass over every weight (and over its gradient in the backward) that buys nothing,
    and it cost +20% of a block's time over float32. A weight stored in `dtype` (model.param_dtype=bfloat16) is not
    upcast either: its dots stay 16-bit with float32 sums (models/cpu_dot.py), XLA:CPU's fast path for them.
    Elsewhere both operands are cast to `dtype`, as nnx.Linear."""
    if cpu_fp32 and fp32_here(dtype):
        if cpu_dot.applies(dtype, w.dtype) and dimension_numbers == (((x.ndim - 1,), (0,)), ((), ())):
            return cpu_dot.matmul_f32(x.astype(dtype), w).astype(dtype)
        x32, w32 = x.astype(dtype).astype(jnp.float32), w.astype(jnp.float32)
        return jax.lax.dot_general(x32, w32, dimension_numbers).astype(dtype)
    return jax.lax.dot_general(x.astype(dtype), w.astype(dtype), dimension_numbers)


def einsum(spec: str, x: jax.Array, w: jax.Array, *, dtype: Any, cpu_fp32: bool) -> jax.Array:
    """`jnp.einsum(spec, x, w)` under the rule of `dot_general` (activations `x`, weights or a second activation
    `w`, the result in `dtype`)."""
    if cpu_fp32 and fp32_here(dtype):
        x32, w32 = x.astype(dtype).astype(jnp.float32), w.astype(jnp.float32)
        return jnp.einsum(spec, x32, w32).astype(dtype)
    return jnp.einsum(spec, x.astype(dtype), w.astype(dtype))


class Linear(nnx.Linear):
    """`nnx.Linear` (same parameters, same paths: kernel, bias) whose product follows the families' matmul rule
    (`dot_general`; the bias is added in float32 there, before the one rounding). `cpu_fp32`:
    model.cpu_matmul_fp32."""

    def __init__(self, in_features: int, out_features: int, *, cpu_fp32: bool, **kwargs: Any):
        super().__init__(in_features, out_features, **kwargs)
        self.cpu_fp32 = cpu_fp32

    def __call__(self, inputs: jax.Array, out_sharding: Any = None) -> jax.Array:
        dtype = self.dtype or inputs.dtype
        if out_sharding is not None or not (self.cpu_fp32 and fp32_here(dtype)):
            return super().__call__(inputs, out_sharding)
        kernel = self.kernel[...]
        if cpu_dot.applies(dtype, kernel.dtype):  # a 16-bit weight: 16-bit dots summed in float32
            y = cpu_dot.matmul_f32(inputs.astype(dtype), kernel)
        else:
            x32 = inputs.astype(dtype).astype(jnp.float32)
            y = jax.lax.dot_general(x32, kernel.astype(jnp.float32), (((x32.ndim - 1,), (0,)), ((), ())))
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y.astype(dtype)


def stage_key(key: jax.Array, stage: int | jax.Array) -> jax.Array:
    """The key stage `stage` draws its parameters from (0 = embed, 1 + j = block j, n_layers + 1 = head): a stage
    is initialised from its own key alone, so it can be created without the rest of the model."""
    return jax.random.fold_in(key, stage)


def cross_entropy(logits: jax.Array, targets: jax.Array, count: jax.Array | float | None = None) -> jax.Array:
    """Next-token cross-entropy in float32: summed over the scored targets (angel_jax/data/marks.py: a target
    marked unscored, a prompt's token or padding, adds nothing), divided by `count`.

    `count` None: the number of scored targets here (at least 1), the mean over them. An engine that splits a batch
    into pieces (micro-batches, ranks) and averages the pieces' losses passes each piece the batch's scored count
    divided by the number of pieces, so that the average is the whole batch's mean whatever the pieces hold
    (`scored_share`). On text data every target is scored and this is the plain mean."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, token_marks.token_ids(targets)[..., None], axis=-1)[..., 0]
    scored = token_marks.scored(targets)
    if count is None:
        count = jnp.maximum(jnp.sum(scored), 1).astype(jnp.float32)
    return -jnp.sum(jnp.where(scored, picked, 0.0)) / count


def scored_share(targets: jax.Array, pieces: int) -> jax.Array:
    """The `count` each of `pieces` equal pieces of `targets` (a whole batch's) passes `cross_entropy`: the batch's
    scored targets (at least 1) / pieces, float32."""
    return jnp.maximum(jnp.sum(token_marks.scored(targets)), 1).astype(jnp.float32) / jnp.float32(pieces)


def pure_dict(state: nnx.State) -> dict[str, Any]:
    """The state as nested dicts of arrays. Newer flax deprecates State.to_pure_dict for the module-level
    nnx.to_pure_dict; older 0.12 releases lack it."""
    to_pure = getattr(nnx, "to_pure_dict", None)
    return to_pure(state) if to_pure is not None else state.to_pure_dict()


Params = dict[str, Any]


def whole_params(model: Callable[[Any, jax.Array], nnx.Module], cfg: Any, seed: int) -> tuple[nnx.GraphDef, Params]:
    """(graphdef, params) of the whole model `model(cfg, key)` built from `seed`: a family's `init`."""
    graphdef, state = nnx.split(model(cfg, jax.random.key(seed)))
    return graphdef, pure_dict(state)


def abstract_params_of(model: Callable[[Any, jax.Array], nnx.Module], cfg: Any) -> tuple[nnx.GraphDef, Params]:
    """(graphdef, params as jax.ShapeDtypeStruct) of the whole model, allocating nothing: a family's
    `abstract_params`."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: model(cfg, jax.random.key(0))))
    return graphdef, pure_dict(state)


def one_stage_params(seed: int, stage: int, count: int, build: Callable[[int, nnx.Rngs], nnx.Module]) -> Params:
    """Stage `stage`'s params alone, from its own key (`stage_key`): `build(stage, rngs)` makes that stage's module,
    and only its arrays are created. A family's `init_stage`, equal bit for bit to its whole model's split when the
    whole model draws each stage from the same key."""
    if not 0 <= stage < count:
        raise IndexError(f"stage {stage} out of range: the model has {count} stages")
    rngs = nnx.Rngs(params=stage_key(jax.random.key(seed), stage))
    return pure_dict(nnx.state(build(stage, rngs)))


def family_functions(family: ModuleType, cfg: Any, documents: bool = False) -> dict[str, Any]:
    """The `StagedModel` fields every family fills from its module's functions of the config: init, init_stage,
    abstract, param_count, flops_per_token. `documents`: the whole model's graphdef runs rows of packed documents
    (models/documents.py; a family that can has `documents` in its init and abstract_params)."""
    by_rows = {"documents": True} if documents else {}
    return {"init": lambda seed: family.init(cfg, seed, **by_rows),
            "init_stage": lambda seed, stage: family.init_stage(cfg, seed, stage),
            "abstract": lambda: family.abstract_params(cfg, **by_rows),
            "param_count": family.param_count(cfg),
            "flops_per_token": family.flops_per_token(cfg)}
