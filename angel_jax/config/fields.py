"""The one field-doc and strict-loading helper of every typed config (and every JSON-restored state).

    @dataclass
    class TrainConfig:
        steps: int = doc(1000, "Optimizer steps to run.")

    value = typed(raw, int, "'train.steps' in run.yaml")   # checked against the annotation, or ConfigError

`doc`/`sub` attach the one-line description that `angel-jax train --help-config` shows (metadata key "doc").
`typed` checks a plain (YAML / JSON) value against a type annotation: the only conversions are int -> float and
list -> tuple; floats must be finite (no setting or state means anything with NaN or an infinity).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import field
from typing import Any, Literal

from angel_jax.errors import AngelError


class ConfigError(AngelError, ValueError):
    """A configuration problem; the message names the key and where it came from."""


def doc(default: Any, text: str) -> Any:
    """A dataclass field with a default and a one-line description."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"doc": text})
    return field(default=default, metadata={"doc": text})


def sub(cls: type, text: str) -> Any:
    """A nested config section."""
    return field(default_factory=cls, metadata={"doc": text})


def field_doc(cls: type, name: str) -> str:
    """The one-line description of field `name` of dataclass `cls` ("" when it has none)."""
    return next(f.metadata.get("doc", "") for f in dataclasses.fields(cls) if f.name == name)


def type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def typed(value: Any, tp: Any, where: str) -> Any:
    """`value` checked against the annotation `tp` (Literal, unions, tuple[...], bool, int, float, str, ...);
    raises ConfigError starting with `where`."""
    kind, args = typing.get_origin(tp), typing.get_args(tp)
    if kind is Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if kind in (typing.Union, types.UnionType):
        for option in args:
            if option is type(None) and value is None:
                return None
            try:
                return typed(value, option, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where}: {value!r} is not a {type_name(tp)}")
    if kind is tuple:
        if isinstance(value, (list, tuple)):
            if len(args) == 2 and args[1] is Ellipsis:
                return tuple(typed(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
            if len(value) == len(args):
                return tuple(typed(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        raise ConfigError(f"{where}: {value!r} is not a {type_name(tp)}")
    if kind is not None:  # dict[...], list[...]: the container type only
        tp = kind
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{where}: {value!r} is not None")
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, bool) or not isinstance(value, tp):
        raise ConfigError(f"{where}: expected {type_name(tp)}, got {type(value).__name__} {value!r}")
    if tp is float and not math.isfinite(value):
        raise ConfigError(f"{where}: must be a finite number, got {value!r}")
    return value


def check(errs: list, ok: bool, key: str, problem: str) -> None:
    """Validation helper: append (key, problem) unless `ok`."""
    if not ok:
        errs.append((key, problem))
