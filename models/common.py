"""Pieces every model family shares: the per-stage random keys, the loss, the pure-dict view of NNX state, and how
a family builds its parameters whole, abstractly or one stage at a time."""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx


def stage_key(key: jax.Array, stage: int | jax.Array) -> jax.Array:
    """The key stage `stage` draws its parameters from (0 = embed, 1 + j = block j, n_layers + 1 = head): a stage
    is initialised from its own key alone, so it can be created without the rest of the model."""
    return jax.random.fold_in(key, stage)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in float32."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


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


def family_functions(family: ModuleType, cfg: Any) -> dict[str, Any]:
    """The `StagedModel` fields every family fills from its module's functions of the config: init, init_stage,
    abstract, param_count, flops_per_token."""
    return {"init": lambda seed: family.init(cfg, seed),
            "init_stage": lambda seed, stage: family.init_stage(cfg, seed, stage),
            "abstract": lambda: family.abstract_params(cfg),
            "param_count": family.param_count(cfg),
            "flops_per_token": family.flops_per_token(cfg)}
