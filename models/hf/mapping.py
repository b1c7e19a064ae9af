"""The pieces every family's Hugging Face mapping is made of: tensor tables and config.json field reading.

A family describes each of its stages as a table of `Tensor` entries: where a leaf sits in our stage's params,
which HF tensor holds it, and whether it is stored transposed (torch's nn.Linear keeps [out, in]; our Linear
kernels are [in, out]). The same table converts both ways (`stage_from_hf`, `iter_stage_to_hf`), so import and export
cannot drift apart; the expected shapes come from the stage's own abstract params.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import jax
import numpy as np

from angel_jax.config import ConfigError

Params = dict


@dataclass(frozen=True)
class Tensor:
    path: tuple[str, ...]
    """Where the leaf sits in our stage's params, e.g. ('qkv', 'kernel')."""
    names: tuple[str, ...]
    """The HF tensor's name; further names are read when the first is absent (a head tied to the embedding is
    stored once, under the embedding's name). Export writes the first."""
    transposed: bool = False
    """HF stores the transpose of our leaf (torch nn.Linear weights: [out, in])."""


class TensorSource:
    """The tensors of one checkpoint as a family asks for them: by full name, with or without the base model's
    prefix (`transformer.` / `model.`: a checkpoint of the bare base model has none)."""

    def __init__(self, files: Any, prefix: str):
        self.files, self.prefix = files, prefix

    def resolve(self, name: str) -> str | None:
        if name in self.files:
            return name
        if name.startswith(self.prefix) and name[len(self.prefix):] in self.files:
            return name[len(self.prefix):]
        return None

    def get(self, names: tuple[str, ...], shape: tuple[int, ...]) -> np.ndarray:
        for name in names:
            found = self.resolve(name)
            if found is not None:
                return self.files.get(found, shape)
        return self.files.get(names[0], shape)  # raises, naming the tensor and the shape expected


def stage_from_hf(table: list[Tensor], source: TensorSource, abstract: Params, dtype: Any) -> Params:
    """Our stage's params (numpy, `dtype`) from the HF tensors `table` names; shapes checked against `abstract`."""
    _check_complete(abstract, table)
    out: Params = {}
    for t in table:
        leaf = _at(abstract, t.path)
        shape = tuple(leaf.shape)
        value = source.get(t.names, shape[::-1] if t.transposed else shape)
        value = value.T if t.transposed else value
        _put(out, t.path, np.asarray(value, dtype=dtype))
    return out


def iter_stage_to_hf(table: list[Tensor], params: Params, dtype: Any) -> Iterator[tuple[str, np.ndarray]]:
    """The HF tensors of our stage's params one at a time, in the table's order (numpy, C order, `dtype`): a
    writer that consumes each before asking for the next holds one converted tensor at most."""
    _check_complete(params, table)
    for t in table:
        value = np.asarray(_at(params, t.path))
        # One copy at most (a transpose and a cast together); none for a leaf already in C order and `dtype`.
        yield t.names[0], np.ascontiguousarray(value.T if t.transposed else value, dtype=dtype)


def stage_hf_shapes(table: list[Tensor], abstract: Params) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of the HF tensors of a stage, in the order `iter_stage_to_hf` gives them, from the stage's
    abstract params (anything with `.shape` leaves): what a file's header needs before any value is read."""
    _check_complete(abstract, table)
    out = []
    for t in table:
        shape = tuple(_at(abstract, t.path).shape)
        out.append((t.names[0], shape[::-1] if t.transposed else shape))
    return out


def _at(tree: Mapping, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _put(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _check_complete(stage: Params, table: list[Tensor]) -> None:
    """Every leaf of the stage is in the table exactly once (a table that forgets one is a bug, not bad input)."""
    leaves = {tuple(k.key for k in path) for path, _ in jax.tree_util.tree_leaves_with_path(stage)}
    mapped = [t.path for t in table]
    if sorted(mapped) != sorted(leaves) or len(set(mapped)) != len(mapped):
        raise AssertionError(f"tensor table covers {sorted(mapped)}, the stage has {sorted(leaves)}")


# --------------------------------------------------------------------------------------------- config.json


class HFConfig:
    """A config.json's values, read with the defaults transformers applies to keys it leaves out, and typed:
    a wrong type or an unsupported value is a ConfigError naming the HF key and the file."""

    def __init__(self, raw: Mapping[str, Any], defaults: Mapping[str, Any], where: str):
        self.raw, self.defaults, self.where = raw, defaults, where

    def value(self, key: str) -> Any:
        return self.raw[key] if self.raw.get(key) is not None else self.defaults.get(key)

    def int(self, key: str, minimum: int = 1) -> int:
        v = self.value(key)
        if type(v) is not int or v < minimum:
            raise ConfigError(f"{self.where}: {key!r} must be an integer >= {minimum}, got {v!r}")
        return v

    def float(self, key: str) -> float:
        v = self.value(key)
        if type(v) not in (int, float) or not np.isfinite(v) or v <= 0:
            raise ConfigError(f"{self.where}: {key!r} must be a finite number > 0, got {v!r}")
        return float(v)

    def require(self, key: str, ok: Callable[[Any], bool], supported: str) -> None:
        """Refuse a setting the model here does not implement (naming the key, its value and what works)."""
        v = self.value(key)
        if not ok(v):
            raise ConfigError(f"{self.where}: {key}={v!r} is not supported (supported: {supported})")
