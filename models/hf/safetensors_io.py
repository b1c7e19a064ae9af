"""Reading and writing the tensors of a Hugging Face checkpoint directory (safetensors), numpy only.

A checkpoint holds `model.safetensors`, or shards named by `model.safetensors.index.json` (its `weight_map`:
tensor name -> file). `CheckpointTensors` reads the headers once and then one tensor at a time (safetensors maps
the file; a tensor is read when asked for), so a model larger than RAM is imported stage by stage.

numpy has no bfloat16 of its own, and safetensors' numpy API refuses BF16 tensors (most Llama checkpoints): those
are read through the same package's flax API on the CPU and handed over as ml_dtypes bfloat16 arrays, the type
`jnp.bfloat16` is. Writing bfloat16 works through the numpy API.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from angel_jax.errors import AngelError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointFileError(AngelError):
    """A Hugging Face checkpoint's files are missing, unreadable, or lack a tensor the model needs."""


class CheckpointTensors:
    """The tensors of one checkpoint directory: names, shapes and dtypes from the headers; data on demand."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.file_of: dict[str, Path] = {}
        self.header: dict[str, tuple[tuple[int, ...], str]] = {}  # name -> (shape, safetensors dtype)
        single, index = self.directory / SINGLE_FILE, self.directory / INDEX_FILE
        if single.is_file():
            files = [single]
        elif index.is_file():
            files = self._from_index(index)
        else:
            raise CheckpointFileError(f"{self.directory}: no {SINGLE_FILE} (nor {INDEX_FILE}); a Hugging Face "
                                      "checkpoint saved with save_pretrained(safe_serialization=True) has one")
        for path in files:
            for name, (shape, dtype) in _read_header(path).items():
                self.file_of[name] = path
                self.header[name] = (shape, dtype)

    def _from_index(self, index: Path) -> list[Path]:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointFileError(f"{index}: not a safetensors index (a JSON object with 'weight_map'): {e}") \
                from None
        files = sorted({self.directory / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointFileError(f"{index} names shard files that do not exist: {', '.join(missing)}")
        return files

    def __contains__(self, name: str) -> bool:
        return name in self.header

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """The tensor `name`, which must have `shape` (the shape the model's config implies)."""
        if name not in self.header:
            raise CheckpointFileError(f"{self.directory}: the checkpoint has no tensor {name!r} "
                                      f"(its config.json implies one of shape {list(shape)})")
        have, dtype = self.header[name]
        if tuple(have) != tuple(shape):
            raise CheckpointFileError(f"{self.file_of[name]}: tensor {name!r} has shape {list(have)}, but "
                                      f"config.json implies {list(shape)}")
        path = self.file_of[name]
        try:
            if dtype == "BF16":
                return _read_bfloat16(path, name)
            with safe_open(str(path), framework="numpy") as f:
                return f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointFileError(f"{path}: cannot read tensor {name!r}: {e}") from None


def _read_header(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    try:
        with safe_open(str(path), framework="numpy") as f:
            return {name: (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype()) for name in f.keys()}
    except (SafetensorError, OSError) as e:
        raise CheckpointFileError(f"{path}: not a readable safetensors file: {e}") from None


def _read_bfloat16(path: Path, name: str) -> np.ndarray:
    import jax  # only for checkpoints stored in bfloat16

    with jax.default_device(jax.devices("cpu")[0]), safe_open(str(path), framework="flax") as f:
        return np.asarray(f.get_tensor(name))


def write(path: str | Path, tensors: dict[str, np.ndarray]) -> None:
    """Write `tensors` to the safetensors file `path` atomically (a temporary file renamed over it). The metadata
    says "format": "pt", which transformers checks before loading a file into PyTorch."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, 0o644)  # safetensors creates the file private (0600); an export is an ordinary file to share
    os.replace(tmp, path)
