"""Model families, each behind the stage seam (`models/stages.py`): the registry is the only place that names them.

    model = models.get(cfg.model)     # a StagedModel: stages, apply functions, loss, init, parameter counts

The framework (optimizer, scheduling pass, engines, loop) sees only what a `StagedModel` offers; a new family is a
module here with a `staged(cfg) -> StagedModel` function and one line in FAMILIES.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

from angel_jax.config import ConfigError, ModelConfig
from models.stages import Stage, StagedModel

FAMILIES = {"gpt": "models.gpt", "llama": "models.llama"}
"""model.name -> the module that builds it (imported on first use: a family's dependencies load only when used)."""


def get(cfg: ModelConfig) -> StagedModel:
    """The stage view of the model `cfg` describes (no arrays are allocated; built once per distinct config)."""
    if cfg.name not in FAMILIES:
        raise ConfigError(f"'model.name': unknown model {cfg.name!r}; known: {', '.join(sorted(FAMILIES))}")
    return _get(dataclasses.astuple(cfg))


@functools.lru_cache(maxsize=16)
def _get(key: tuple) -> StagedModel:  # a StagedModel is immutable: one per config serves every caller
    cfg = ModelConfig(*key)
    return importlib.import_module(FAMILIES[cfg.name]).staged(cfg)


__all__ = ["FAMILIES", "Stage", "StagedModel", "get"]
