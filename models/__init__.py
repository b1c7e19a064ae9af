"""Model families, each behind the stage seam (`models/stages.py`): the registry is the only place that names them.

    model = models.get(cfg.model)     # a StagedModel: stages, apply functions, loss, init, parameter counts

The framework (optimizer, scheduling pass, engines, loop) sees only what a `StagedModel` offers; a new family is a
module here with a `staged(cfg) -> StagedModel` function and one line in FAMILIES.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
from dataclasses import dataclass

from angel_jax.config import ConfigError, ModelConfig
from models.stages import Stage, StagedModel

FAMILIES = {"gpt": "models.gpt", "llama": "models.llama", "t5": "models.t5"}
"""model.name -> the module that builds it (imported on first use: a family's dependencies load only when used)."""


DOCUMENTS = ("gpt", "llama")
"""The families that run rows of packed documents (`get(..., documents=True)`, models/documents.py), with dense or
mixture-of-experts blocks."""


def get(cfg: ModelConfig, documents: bool = False) -> StagedModel:
    """The stage view of the model `cfg` describes (no arrays are allocated; built once per distinct config).
    `documents`: its rows hold packed documents, each attending only to itself (instruction data with data.pack;
    the parameters are the same)."""
    if cfg.name not in FAMILIES:
        raise ConfigError(f"'model.name': unknown model {cfg.name!r}; known: {', '.join(sorted(FAMILIES))}")
    if documents and cfg.name not in DOCUMENTS:
        raise ConfigError(f"'data.pack': rows of packed documents run on the {' and '.join(DOCUMENTS)} families, "
                          f"not model.name={cfg.name!r}: set data.pack=false (one record per row, padded)")
    return _get(_Key(copy.deepcopy(cfg), documents))


def param_count(cfg: ModelConfig) -> dict[str, int]:
    """The parameter counts of `get(cfg)`, from the config alone: arithmetic, nothing built, so a model too large
    in any dimension (a billion layers) is sized at once."""
    if cfg.name not in FAMILIES:
        raise ConfigError(f"'model.name': unknown model {cfg.name!r}; known: {', '.join(sorted(FAMILIES))}")
    return importlib.import_module(FAMILIES[cfg.name]).param_count(cfg)


@dataclass(frozen=True, eq=False)
class _Key:
    """A model config as a cache key: equal when every field is, nested sections (model.moe) included."""

    cfg: ModelConfig
    documents: bool = False

    def __hash__(self) -> int:
        return hash((dataclasses.astuple(self.cfg), self.documents))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, _Key) and dataclasses.astuple(self.cfg) == dataclasses.astuple(other.cfg)
                and self.documents == other.documents)


@functools.lru_cache(maxsize=16)
def _get(key: _Key) -> StagedModel:  # a StagedModel is immutable: one per config serves every caller
    cfg = key.cfg
    family = importlib.import_module(FAMILIES[cfg.name])
    staged = family.staged(cfg, documents=True) if key.documents else family.staged(cfg)
    if cfg.init_from:  # parameters from a Hugging Face checkpoint instead of the random init
        from models import hf

        staged = hf.from_pretrained(staged, cfg)
    return staged


def check_init_from(cfg: ModelConfig) -> None:
    """With model.init_from: refuse, before anything is built, a checkpoint directory that is missing, lacks its
    files or holds another architecture than `cfg` (ConfigError naming the first key that differs)."""
    if cfg.init_from:
        from models import hf

        hf.check_matches(cfg, cfg.init_from)
        hf.CheckpointTensors(cfg.init_from)  # reads the headers: a missing or unreadable weights file fails here


__all__ = ["DOCUMENTS", "FAMILIES", "Stage", "StagedModel", "check_init_from", "get", "param_count"]
