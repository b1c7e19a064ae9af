"""The snapshot directory format shared by the memory tier and the peer tier, and the code that reads and checks it.

A snapshot of step k is a directory `step_<k>/` holding two files:

    data.bin     every array's raw bytes (C order, little-endian), each starting at a 4096-byte aligned offset
    index.json   {"format": "angel_jax.snapshot/3", "step": k, "data_bytes": N, "meta": {...},
                  "arrays": [{"name", "dtype", "shape", "offset", "nbytes", "xxh3_64"}, ...],
                  "index_xxh3_64": XXH3-64 of the rest of the index (canonical JSON)}

The index checksum covers the meta (the data iterator's position, the config, the step) as the array checksums
cover the arrays: an edited or damaged index.json is a damaged checkpoint, and restore falls back to another copy.
Indexes of format /2 (written before the index had its checksum) are still read.

No pickle anywhere: dtypes are stored by name (`float32`, `bfloat16`, ...), meta must be JSON. One data file per
snapshot (not one per array) keeps the file-descriptor and mmap count independent of the number of arrays, which
matters for the paged engine's thousands of pages. Aligned offsets let restore hand out zero-copy views.

A snapshot is written under `step_<k>.tmp/` and renamed to `step_<k>/` only after index.json (with checksums) is
complete, so the name `step_<k>` is the commit marker: a `.tmp` directory is never read as a checkpoint.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import shutil
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping

import ml_dtypes
import numpy as np

from angel_jax.checkpoint.checksum import ALGORITHM, digest, digest_many

FORMAT = "angel_jax.snapshot/3"
LEGACY_FORMATS = ("angel_jax.snapshot/2",)  # no index checksum
INDEX_CHECKSUM = f"index_{ALGORITHM}"
INDEX_FILE = "index.json"
DATA_FILE = "data.bin"
ALIGN = 4096
_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_RE = re.compile(r"^step_(\d+)\.tmp$")
_REJECTED_KINDS = "OUSMm"  # objects, strings, datetimes: not raw numeric bytes


# ------------------------------------------------------------------------------------------------- dtypes


def encode_dtype(dtype: np.dtype) -> str:
    """A dtype's portable name; rejects what cannot round-trip as raw little-endian bytes."""
    dt = np.dtype(dtype)
    if dt.kind in _REJECTED_KINDS or dt.fields is not None or dt.hasobject:
        raise TypeError(f"dtype {dt} cannot be checkpointed as raw bytes (numeric and bool dtypes only)")
    if dt.byteorder == ">":
        raise TypeError(f"big-endian dtype {dt} is not supported; convert to native byte order first")
    if decode_dtype(dt.name) != dt:
        raise TypeError(f"dtype {dt} has no portable name")
    return dt.name


def decode_dtype(name: str) -> np.dtype:
    """Inverse of `encode_dtype`; ml_dtypes names (bfloat16, float8_*, int4) resolve even where numpy lacks them."""
    ml = getattr(ml_dtypes, name, None)
    if ml is not None and isinstance(ml, type):
        return np.dtype(ml)
    try:
        return np.dtype(name)
    except TypeError as e:
        raise ValueError(f"unknown dtype name {name!r}") from e


# ------------------------------------------------------------------------------------------------- index


@dataclass(frozen=True)
class ArrayEntry:
    """Where one array lives in data.bin and what its bytes must hash to."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    checksum: int | None = None
    """XXH3-64 of the array's bytes (checksum.py); None only while the snapshot is still being written."""

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "offset": self.offset,
                "nbytes": self.nbytes, ALGORITHM: self.checksum}

    @staticmethod
    def from_json(obj: Mapping[str, Any]) -> "ArrayEntry":
        entry = ArrayEntry(name=str(obj["name"]), dtype=str(obj["dtype"]), shape=tuple(int(d) for d in obj["shape"]),
                           offset=int(obj["offset"]), nbytes=int(obj["nbytes"]),
                           checksum=None if obj.get(ALGORITHM) is None else int(obj[ALGORITHM]))
        expected = math.prod(entry.shape) * decode_dtype(entry.dtype).itemsize
        if expected != entry.nbytes or entry.offset < 0:
            raise ValueError(f"array {entry.name!r}: nbytes {entry.nbytes} does not match "
                             f"{entry.dtype}{list(entry.shape)}")
        return entry


@dataclass(frozen=True)
class SnapshotIndex:
    """Everything needed to interpret data.bin; also the `meta` item of the persistent (orbax) checkpoint."""

    step: int
    arrays: tuple[ArrayEntry, ...]
    meta: dict[str, Any]
    data_bytes: int

    def to_json(self) -> dict[str, Any]:
        body = {"format": FORMAT, "step": self.step, "data_bytes": self.data_bytes, "meta": self.meta,
                "arrays": [a.to_json() for a in self.arrays]}
        return {**body, INDEX_CHECKSUM: _index_digest(body)}

    @staticmethod
    def from_json(obj: Mapping[str, Any]) -> "SnapshotIndex":
        if obj.get("format") not in (FORMAT, *LEGACY_FORMATS):
            raise ValueError(f"unknown format {obj.get('format')!r} (expected {FORMAT!r})")
        arrays = tuple(ArrayEntry.from_json(a) for a in obj["arrays"])
        index = SnapshotIndex(step=int(obj["step"]), arrays=arrays, meta=dict(obj["meta"]),
                              data_bytes=int(obj["data_bytes"]))
        for a in arrays:
            if a.offset + a.nbytes > index.data_bytes:
                raise ValueError(f"array {a.name!r} extends past data_bytes={index.data_bytes}")
        if obj.get("format") == FORMAT:
            body = {k: v for k, v in obj.items() if k != INDEX_CHECKSUM}
            if obj.get(INDEX_CHECKSUM) != _index_digest(body):
                raise ValueError(f"index checksum mismatch ({INDEX_CHECKSUM} {_index_digest(body):#018x}, "
                                 f"expected {obj.get(INDEX_CHECKSUM)!r}): the index or its meta was changed")
        return index

    def with_checksums(self, digests: list[int]) -> "SnapshotIndex":
        return replace(self, arrays=tuple(replace(a, checksum=c) for a, c in zip(self.arrays, digests)))

    @property
    def checksums(self) -> dict[str, int | None]:
        return {a.name: a.checksum for a in self.arrays}


def _index_digest(body: Mapping[str, Any]) -> int:
    """XXH3-64 of an index without its checksum, as canonical JSON (sorted keys, no spaces): the same value
    whatever wrote or re-wrote the JSON (orbax's JSON handler for the persistent tier)."""
    text = json.dumps(body, sort_keys=True, allow_nan=True, separators=(",", ":"))
    return digest(memoryview(text.encode()))


def plan_layout(step: int, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> SnapshotIndex:
    """Offsets for every array (aligned, in the caller's order); checksums left empty. Validates the input."""
    meta = dict(meta)
    json.dumps(meta, allow_nan=True)  # raises TypeError naming the offending type before anything is written
    entries, offset = [], 0
    for name, arr in arrays.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"array names must be non-empty strings, got {name!r}")
        entries.append(ArrayEntry(name=name, dtype=encode_dtype(arr.dtype), shape=tuple(int(d) for d in arr.shape),
                                  offset=offset, nbytes=int(arr.nbytes)))
        offset += -(-int(arr.nbytes) // ALIGN) * ALIGN
    return SnapshotIndex(step=int(step), arrays=tuple(entries), meta=meta, data_bytes=offset)


# ------------------------------------------------------------------------------------------------- directories


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step}"


def tmp_dir(root: Path, step: int) -> Path:
    return root / f"step_{step}.tmp"


def scan(root: Path | None) -> tuple[dict[int, Path], dict[int, Path]]:
    """(committed, partial) snapshot directories under root, by step; a missing root is an empty tier."""
    committed: dict[int, Path] = {}
    partial: dict[int, Path] = {}
    if root is None or not root.is_dir():
        return committed, partial
    for child in root.iterdir():
        if m := _STEP_RE.match(child.name):
            committed[int(m.group(1))] = child
        elif m := _TMP_RE.match(child.name):
            partial[int(m.group(1))] = child
    return committed, partial


def is_snapshot_dir(entry: Path) -> bool:
    """Whether `entry` is a directory this module writes into a tier: `step_<k>` or `step_<k>.tmp` (not a link)
    holding nothing but snapshot files. Callers that clean a tier delete only such entries."""
    if entry.is_symlink() or not entry.is_dir() or not (_STEP_RE.match(entry.name) or _TMP_RE.match(entry.name)):
        return False
    return all(f.name in (DATA_FILE, INDEX_FILE) and f.is_file() and not f.is_symlink() for f in entry.iterdir())


def write_index(directory: Path, index: SnapshotIndex) -> None:
    (directory / INDEX_FILE).write_text(json.dumps(index.to_json(), allow_nan=True))


def read_index(directory: Path) -> SnapshotIndex:
    return SnapshotIndex.from_json(json.loads((directory / INDEX_FILE).read_text()))


def dir_bytes(path: Path) -> int:
    """Bytes of the regular files under path (0 for a vanished path: tiers change under us)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except FileNotFoundError:
                pass
    return total


def remove_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------------------------------------- reading


class SnapshotDamaged(Exception):
    """A snapshot directory that cannot be used; `problems` says why, one line each."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


def check_named_step(directory: Path, index: SnapshotIndex, named: int | None) -> None:
    """A checkpoint's step is what its checksummed index says. A directory whose name says another step (renamed,
    or copied over another) is damaged: restoring it as the step its name claims would train one state under
    another's label. `named`: the step the directory's name says (None: the name carries none)."""
    if named is not None and named != index.step:
        raise SnapshotDamaged([f"{directory}: holds step {index.step}, but its name says step {named} (renamed or "
                               "copied over?); not used as either"])


def _named_step(directory: Path) -> int | None:
    m = _STEP_RE.match(directory.name)
    return int(m.group(1)) if m else None


def open_arrays(directory: Path, *, private: bool) -> tuple[SnapshotIndex, dict[str, np.ndarray]]:
    """Zero-copy views of a committed snapshot's arrays, without checksum verification.

    private=True maps copy-on-write: the caller may write to the arrays, the file stays as it was.
    private=False maps read-only (what persistence and peer copies use). Raises SnapshotDamaged.
    """
    try:
        index = read_index(directory)
    except FileNotFoundError:
        raise SnapshotDamaged([f"{directory / INDEX_FILE}: missing"]) from None
    except (ValueError, KeyError, TypeError) as e:
        raise SnapshotDamaged([f"{directory / INDEX_FILE}: unreadable ({e})"]) from None
    check_named_step(directory, index, _named_step(directory))
    return map_data(directory, index, private=private)


def map_data(directory: Path, index: SnapshotIndex, *, private: bool) -> tuple[SnapshotIndex, dict[str, np.ndarray]]:
    """Views of data.bin laid out by `index` (which may come from memory rather than index.json)."""
    data_path = directory / DATA_FILE
    try:
        size = os.stat(data_path).st_size
    except FileNotFoundError:
        raise SnapshotDamaged([f"{data_path}: missing"]) from None
    if size != index.data_bytes:
        raise SnapshotDamaged([f"{data_path}: {size} bytes, index says {index.data_bytes} (truncated or overwritten)"])
    mm = None
    if index.data_bytes:
        with open(data_path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY if private else mmap.ACCESS_READ)
    arrays: dict[str, np.ndarray] = {}
    for a in index.arrays:
        dtype = decode_dtype(a.dtype)
        if a.nbytes == 0:
            arrays[a.name] = np.zeros(a.shape, dtype)
        else:
            arrays[a.name] = np.frombuffer(mm, dtype, count=math.prod(a.shape), offset=a.offset).reshape(a.shape)
    return index, arrays


def bytes_view(arr: np.ndarray) -> memoryview:
    """An array's bytes in C order, as hashed for its checksum (no copy for a contiguous array)."""
    return memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))


def checksummed(index: SnapshotIndex, arrays: Mapping[str, np.ndarray], pool: Executor | None) -> SnapshotIndex:
    """`index` with the checksum of every array filled in from `arrays` (the copy, never the live state)."""
    return index.with_checksums(digest_many([bytes_view(arrays[a.name]) for a in index.arrays], pool))


def verify_arrays(index: SnapshotIndex, arrays: Mapping[str, np.ndarray], pool: Executor | None,
                  where: str) -> list[str]:
    """Problems where arrays do not match the index (missing, wrong dtype/shape, checksum mismatch)."""
    problems, names, bufs, expected = [], [], [], []
    for a in index.arrays:
        arr = arrays.get(a.name)
        if arr is None:
            problems.append(f"{where}: array {a.name!r} missing")
            continue
        if np.dtype(arr.dtype) != decode_dtype(a.dtype) or tuple(arr.shape) != a.shape:
            problems.append(f"{where}: array {a.name!r} is {arr.dtype}{list(arr.shape)}, "
                            f"index says {a.dtype}{list(a.shape)}")
            continue
        if a.checksum is None:
            problems.append(f"{where}: array {a.name!r} has no checksum")
            continue
        names.append(a.name)
        bufs.append(bytes_view(arr))
        expected.append(a.checksum)
    for name, got, want in zip(names, digest_many(bufs, pool), expected):
        if got != want:
            problems.append(f"{where}: array {name!r} checksum mismatch ({ALGORITHM} {got:#018x}, "
                            f"expected {want:#018x})")
    return problems


Select = Callable[[str], bool]
"""Which arrays a partial restore takes, by name (e.g. the parameters of a training state, not its optimizer
state); None = all of them."""


def selected(index: SnapshotIndex, select: Select | None) -> SnapshotIndex:
    """The index restricted to the arrays `select` keeps: what a partial restore reads and verifies."""
    return index if select is None else replace(index, arrays=tuple(a for a in index.arrays if select(a.name)))


def load(directory: Path, *, verify: bool, pool: Executor | None,
         select: Select | None = None) -> tuple[SnapshotIndex, dict[str, np.ndarray]]:
    """A committed snapshot as private (copy-on-write) arrays, those `select` keeps (all by default); raises
    SnapshotDamaged naming every problem. The arrays are views of the mapped file: with `select`, the bytes of
    the others are never read, nor checksummed."""
    index, arrays = open_arrays(directory, private=True)
    chosen = selected(index, select)
    arrays = {a.name: arrays[a.name] for a in chosen.arrays if a.name in arrays}
    problems = verify_arrays(chosen, arrays, pool, str(directory)) if verify else []
    if problems:
        raise SnapshotDamaged(problems)
    return index, arrays


def check(directory: Path, pool: Executor | None) -> list[str]:
    """Every problem of a committed snapshot (structure and checksums); empty = usable."""
    try:
        index, arrays = open_arrays(directory, private=False)
    except SnapshotDamaged as e:
        return e.problems
    return verify_arrays(index, arrays, pool, str(directory))


# ------------------------------------------------------------------------------------------------- copying


def copy_committed(src: Path, dst_root: Path, step: int, fault: Any = None) -> Path:
    """Copies a committed snapshot to dst_root/step_<k>/ (tmp dir, fsync, rename): the peer backup.

    The files are fsynced because a peer directory is typically a network or disk mount, unlike /dev/shm.
    `fault` is called between the data copy and the commit (fault injection only).
    """
    dst_root.mkdir(mode=0o700, parents=True, exist_ok=True)  # private: no other user reads or plants copies
    tmp, final = tmp_dir(dst_root, step), step_dir(dst_root, step)
    remove_dir(tmp)
    tmp.mkdir()
    try:
        for name in (DATA_FILE, INDEX_FILE):
            shutil.copyfile(src / name, tmp / name)
        fsync_files(tmp)
    except OSError:
        remove_dir(tmp)  # a full or failing peer keeps no half-written copy (it would hold the space it lacks)
        raise
    if fault is not None:
        fault()
    replace_dir(tmp, final)
    return final


def fsync_files(directory: Path) -> None:
    """Flush every file of a snapshot directory to its disk (before the rename that commits it)."""
    for name in (DATA_FILE, INDEX_FILE):
        fd = os.open(directory / name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def replace_dir(tmp: Path, final: Path) -> None:
    """Renames tmp -> final atomically; an existing final (the same step saved again) is moved aside first."""
    if final.exists():
        old = final.with_name(final.name + ".old")
        remove_dir(old)
        os.rename(final, old)
        os.rename(tmp, final)
        remove_dir(old)
    else:
        os.rename(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # make the rename itself durable on disk-backed tiers
    finally:
        os.close(fd)
