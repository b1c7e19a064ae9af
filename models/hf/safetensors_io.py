"""Reading and writing the tensors of a Hugging Face checkpoint directory (safetensors), numpy only.

A checkpoint holds `model.safetensors`, or shards named by `model.safetensors.index.json` (its `weight_map`:
tensor name -> file). `CheckpointTensors` reads the headers once and then one tensor at a time (safetensors maps
the file; a tensor is read when asked for), so a model larger than RAM is imported stage by stage. Each tensor is
checked as it is read: the shape the config implies, a floating-point dtype, and finite values; a refusal names
the tensor and the file.

numpy has no bfloat16 of its own, and safetensors' numpy API refuses BF16 tensors (most Llama checkpoints): those
are read through the same package's flax API on the CPU and handed over as ml_dtypes bfloat16 arrays, the type
`jnp.bfloat16` is.

Writing streams: `ShardedWriter` is given every tensor's name, shape and dtype first (known from the model's
shapes, before any value is read), splits them into shards of at most `max_shard_size` bytes as huggingface_hub
does, and writes each tensor's bytes into its shard as it comes, after a header computed up front. A safetensors
file is an 8-byte little-endian header length, a JSON header (dtype, shape and byte offsets of every tensor) and the
raw bytes, so nothing but the tensor being written is ever held. Shards are written under temporary names and
renamed once all of them are complete: a failed or interrupted export leaves no file under a final name.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
from safetensors import SafetensorError, safe_open

from angel_jax.errors import AngelError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARD_FILE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
"""A shard's name as transformers writes it: model-00001-of-00003.safetensors."""
DEFAULT_MAX_SHARD_SIZE = "5GB"
"""huggingface_hub's default shard size (and transformers 4.x's)."""
SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
"""KB, MB, GB, TB are decimal, as huggingface_hub reads them ("5GB" is 5 * 10**9 bytes); KiB ... TiB binary."""
DTYPE_CODES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
               "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
"""numpy dtype name -> safetensors dtype code."""
FLOAT_CODE_PREFIXES = ("F", "BF")
"""safetensors codes of floating-point types (F64, F32, F16, BF16, F8_E4M3, ...): what weights are stored as; the
integer and bool codes (I32, U8, BOOL, ...) are not, whatever the tensor's shape."""


class CheckpointFileError(AngelError):
    """A Hugging Face checkpoint's files are missing, unreadable, or lack a tensor the model needs."""


class WriteFailed(CheckpointFileError):
    """Writing a file of a checkpoint failed (an OSError: a full disk); `path` and `reason` say which and why."""

    def __init__(self, message: str, path: Path, reason: str):
        super().__init__(message)
        self.path, self.reason = Path(path), reason


class CheckpointTensors:
    """The tensors of one checkpoint directory: names, shapes and dtypes from the headers; data on demand."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.file_of: dict[str, Path] = {}
        self.header: dict[str, tuple[tuple[int, ...], str]] = {}  # name -> (shape, safetensors dtype)
        single, index = self.directory / SINGLE_FILE, self.directory / INDEX_FILE
        weight_map: dict[str, str] = {}
        if single.is_file():
            files = [single]
        elif index.is_file():
            weight_map = self._read_index(index)
            files = sorted({self.directory / f for f in weight_map.values()})
        else:
            raise CheckpointFileError(f"{self.directory}: no {SINGLE_FILE} (nor {INDEX_FILE}); a Hugging Face "
                                      "checkpoint saved with save_pretrained(safe_serialization=True) has one")
        for path in files:
            for name, (shape, dtype) in _read_header(path).items():
                self.file_of[name] = path
                self.header[name] = (shape, dtype)
        # The index is what transformers trusts: a tensor it places in a shard that does not hold it is damage.
        wrong = [f"{name} -> {file}" for name, file in weight_map.items()
                 if self.file_of.get(name) != self.directory / file]
        if wrong:
            raise CheckpointFileError(f"{index} places tensors in shards that do not hold them: "
                                      f"{', '.join(wrong[:3])}{' ...' if len(wrong) > 3 else ''}")

    @staticmethod
    def _read_index(index: Path) -> dict[str, str]:
        """The index's weight_map (tensor -> shard file name), checked: plain file names beside it, all present."""
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointFileError(f"{index}: not a safetensors index (a JSON object with 'weight_map'): {e}") \
                from None
        if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str) and v
                                                       and Path(v).name == v for k, v in weight_map.items()):
            raise CheckpointFileError(f"{index}: 'weight_map' must map tensor names to file names in the same "
                                      "directory")
        missing = sorted({f for f in weight_map.values() if not (index.parent / f).is_file()})
        if missing:
            raise CheckpointFileError(f"{index} names shard files that do not exist: "
                                      f"{', '.join(str(index.parent / f) for f in missing)}")
        return weight_map

    def __contains__(self, name: str) -> bool:
        return name in self.header

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """The tensor `name`, which must have `shape` (the shape the model's config implies), a floating-point dtype
        and finite values."""
        if name not in self.header:
            raise CheckpointFileError(f"{self.directory}: the checkpoint has no tensor {name!r} "
                                      f"(its config.json implies one of shape {list(shape)})")
        have, dtype = self.header[name]
        if tuple(have) != tuple(shape):
            raise CheckpointFileError(f"{self.file_of[name]}: tensor {name!r} has shape {list(have)}, but "
                                      f"config.json implies {list(shape)}")
        path = self.file_of[name]
        if not dtype.startswith(FLOAT_CODE_PREFIXES):
            raise CheckpointFileError(f"{path}: tensor {name!r} is stored as {dtype}, not a floating-point type (F32, "
                                      "F16, BF16): its bytes are not weights; the file is damaged or was written "
                                      "wrongly (download or export it again)")
        try:
            if dtype == "BF16":
                tensor = _read_bfloat16(path, name)
            else:
                with safe_open(str(path), framework="numpy") as f:
                    tensor = f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointFileError(f"{path}: cannot read tensor {name!r}: {e}") from None
        check_finite(tensor, name, path)
        return tensor


def check_finite(tensor: np.ndarray, name: str, path: Path) -> None:
    """Refuse a tensor holding NaN or infinite values, naming it, how many and where the first is. A model started
    from it would only fail later, at training's anomaly checks, blaming the training instead of the file."""
    # One pass and no copy: the sum (accumulated in float64, cast in small buffers) is finite when every value is;
    # the element-wise test runs only to describe what it found (or to clear a float64 sum that overflowed).
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(tensor.sum(dtype=np.float64)):
            return
    bad = ~np.isfinite(tensor)
    count = int(bad.sum())
    if count == 0:
        return
    nan = int(np.isnan(tensor).sum())
    first = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), tensor.shape))
    raise CheckpointFileError(f"{path}: tensor {name!r} holds {count} non-finite values ({nan} NaN, {count - nan} "
                              f"infinite; the first at index {list(first)}): a model cannot start from it; the file "
                              "is damaged (download or export it again)")


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


# ------------------------------------------------------------------------------------------- streamed, sharded


def parse_size(size: str | int) -> int:
    """A shard size in bytes: an integer, or a number with a unit as huggingface_hub and transformers write it
    ('500MB', '2GB', '5GB' decimal; '1GiB' binary). ValueError naming the text otherwise."""
    if isinstance(size, int) and not isinstance(size, bool):
        value, unit = float(size), "B"
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*", str(size))
        value, unit = (float(match.group(1)), (match.group(2) or "B").upper()) if match else (0.0, "")
    if unit not in SIZE_UNITS or int(value * SIZE_UNITS[unit]) < 1:
        raise ValueError(f"shard size {size!r}: a number of bytes, or of KB, MB, GB, TB (decimal) or KiB, MiB, "
                         "GiB, TiB, e.g. 500MB or 2GB")
    return int(value * SIZE_UNITS[unit])


@dataclass(frozen=True)
class TensorSpec:
    """A tensor as a safetensors header describes it, before its values exist."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def plan_shards(specs: Sequence[TensorSpec], max_bytes: int) -> list[tuple[TensorSpec, ...]]:
    """The tensors, in order, split as huggingface_hub's `split_state_dict_into_shards_factory` splits them: a new
    shard when the next tensor would take the current one past `max_bytes`; a tensor larger than that in a shard
    of its own. Unlike huggingface_hub, which files such a tensor ahead of the shard being filled, it also closes
    that shard: every shard holds a run of consecutive tensors, so tensors arriving in order are written each
    into the one file open, start to end."""
    shards: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    size = 0
    for spec in specs:
        if current and size + spec.nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += spec.nbytes
    if current or not shards:
        shards.append(current)
    return [tuple(s) for s in shards]


def shard_names(count: int) -> list[str]:
    """The file names of `count` shards: model.safetensors alone, or model-00001-of-0000N.safetensors ..."""
    return [SINGLE_FILE] if count == 1 else [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def header_bytes(specs: Sequence[TensorSpec], metadata: dict[str, str]) -> bytes:
    """A safetensors file's first bytes for `specs` stored in this order: the header's length (u64, little-endian)
    and the JSON header, padded with spaces to a multiple of 8 (as safetensors pads it: the data stays aligned)."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for spec in specs:
        if spec.name in header:
            raise ValueError(f"tensor {spec.name!r} is named twice")
        if spec.dtype.name not in DTYPE_CODES:
            raise ValueError(f"tensor {spec.name!r}: dtype {spec.dtype} has no safetensors code")
        header[spec.name] = {"dtype": DTYPE_CODES[spec.dtype.name], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def index_json(shards: Sequence[tuple[TensorSpec, ...]], names: Sequence[str]) -> str:
    """model.safetensors.index.json as transformers writes it (sorted keys, indent 2): the tensors' bytes and
    count, and which file holds each tensor."""
    specs = [spec for shard in shards for spec in shard]
    index = {"metadata": {"total_parameters": sum(s.size for s in specs), "total_size": sum(s.nbytes for s in specs)},
             "weight_map": {spec.name: name for shard, name in zip(shards, names) for spec in shard}}
    return json.dumps(index, indent=2, sort_keys=True) + "\n"


def weight_files(directory: Path) -> list[str]:
    """The weight files of a checkpoint directory: model.safetensors, or the index and the shards it names."""
    if (directory / SINGLE_FILE).is_file():
        return [SINGLE_FILE]
    if (directory / INDEX_FILE).is_file():
        return [INDEX_FILE, *sorted(set(json.loads((directory / INDEX_FILE).read_text())["weight_map"].values()))]
    return []


class ShardedWriter:
    """Writes a checkpoint's tensors into its shard files as they come, in the order `specs` gives (every
    tensor's name, shape and dtype, known before any value is read):

        with ShardedWriter(out_dir, specs, parse_size("2GB")) as w:
            for name, array in tensors():       # one at a time
                w.add(name, array)
            w.commit()                          # renames the shards into place, then writes the index

    Each shard is written to `<name>.tmp`, its header first; `commit` renames them once all are complete, so a
    failure (a full disk, an exception while producing a tensor) removes them and leaves no file under a final
    name, and a killed process leaves only `.tmp` files. One shard: `model.safetensors`, no index (what
    save_pretrained writes for a model under the shard size)."""

    METADATA = {"format": "pt"}
    """transformers checks this before loading a file into PyTorch."""

    def __init__(self, directory: str | Path, specs: Sequence[TensorSpec], max_shard_bytes: int):
        self.directory = Path(directory)
        self.shards = plan_shards(specs, max_shard_bytes)
        self.names = shard_names(len(self.shards))
        self._pending: Iterator[tuple[int, int, TensorSpec]] = iter(
            [(s, k, spec) for s, shard in enumerate(self.shards) for k, spec in enumerate(shard)])
        self._file = None
        self._written: list[Path] = []
        self._committed = False

    def _tmp(self, shard: int) -> Path:
        return self.directory / (self.names[shard] + ".tmp")

    def add(self, name: str, array: np.ndarray) -> None:
        """Write the next tensor; it must be the one `specs` announced next (name, shape, dtype)."""
        shard, k, spec = next(self._pending, (None, None, None))
        if spec is None or (name, tuple(array.shape), np.dtype(array.dtype)) != (spec.name, spec.shape, spec.dtype):
            raise ValueError(f"tensor {name!r} {np.dtype(array.dtype)}{list(array.shape)} given where the plan has "
                             + (f"{spec.name!r} {spec.dtype}{list(spec.shape)}" if spec else "no more tensors"))
        if k == 0:
            self._open(shard)
        data = np.ascontiguousarray(array)
        data = data.astype(data.dtype.newbyteorder("<"), copy=False)  # safetensors stores little-endian
        with self._writing(self._tmp(shard)):
            self._file.write(data.reshape(-1).view(np.uint8).data)
        if k == len(self.shards[shard]) - 1:
            self._close(shard)

    def _open(self, shard: int) -> None:
        path = self._tmp(shard)
        with self._writing(self._tmp(shard)):
            self._file = open(path, "wb")
            self._written.append(path)
            self._file.write(header_bytes(self.shards[shard], self.METADATA))

    def _close(self, shard: int) -> None:
        with self._writing(self._tmp(shard)):
            self._file.flush()
            os.fsync(self._file.fileno())  # complete on disk before the rename makes it the export's
            self._file.close()
            self._file = None

    @contextlib.contextmanager
    def _writing(self, path: Path) -> Iterator[None]:
        """A file operation; an OSError (a full disk) becomes a CheckpointFileError naming the file."""
        try:
            yield
        except OSError as e:
            reason = e.strerror or str(e)
            raise WriteFailed(f"cannot write {path}: {reason}; nothing of the export was written under a final "
                              f"name in {self.directory}", path, reason) from None

    def commit(self) -> list[Path]:
        """Rename the complete shards into place, then the index (several shards); the final paths. The index is
        written before anything is renamed: once a shard has its final name, nothing is left that can fail for
        lack of space."""
        left = next(self._pending, None)
        if left is not None:
            raise ValueError(f"commit before every tensor was written (next: {left[2].name!r})")
        if not self.shards[0]:  # a model without tensors still gets its (empty) file
            self._open(0)
            self._close(0)
        final = [self.directory / name for name in self.names]
        index_tmp = self.directory / (INDEX_FILE + ".tmp")
        if len(self.names) > 1:
            with self._writing(index_tmp):
                self._written.append(index_tmp)
                index_tmp.write_text(index_json(self.shards, self.names))
        for tmp, path in zip(self._written, final):
            os.chmod(tmp, 0o644)  # an export is an ordinary file to share
            os.replace(tmp, path)
        self._committed = True
        _remove_stale(self.directory, keep={*self.names, INDEX_FILE} if len(self.names) > 1 else {SINGLE_FILE})
        if len(self.names) > 1:
            os.chmod(index_tmp, 0o644)
            os.replace(index_tmp, self.directory / INDEX_FILE)
            final.append(self.directory / INDEX_FILE)
        return final

    def abort(self) -> None:
        """Remove what was written (nothing under a final name exists before `commit`)."""
        if self._file is not None:
            with contextlib.suppress(OSError):  # what failed to write fails again in the flush of close()
                self._file.close()
            self._file = None
        for tmp in self._written:
            tmp.unlink(missing_ok=True)

    def __enter__(self) -> "ShardedWriter":
        return self

    def __exit__(self, kind, value, tb) -> None:
        if not self._committed:
            self.abort()


def _remove_stale(directory: Path, keep: set[str]) -> None:
    """An earlier export's weight files that the new one does not replace (model.safetensors beside a new index
    would win over it, in transformers as here; an old index would name shards that are gone)."""
    for path in directory.iterdir():
        if path.name not in keep and (path.name in (SINGLE_FILE, INDEX_FILE) or SHARD_FILE.match(path.name)):
            path.unlink()


def existing_weights(directory: Path) -> list[str]:
    """The weight files of an earlier export in `directory` (model.safetensors, the index, shards)."""
    if not directory.is_dir():
        return []
    return sorted(p.name for p in directory.iterdir()
                  if p.name in (SINGLE_FILE, INDEX_FILE) or SHARD_FILE.match(p.name))
