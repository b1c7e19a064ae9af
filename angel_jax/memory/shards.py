"""A process's own shards of pages sharded over the devices of several processes, and whole pages made from them.

The sharded paged engine (ZeRO-3) holds every global page as a 1-D jax.Array split evenly over the mesh's ranks,
rank r's shard being elements [r x L, (r + 1) x L). With the ranks in several processes, each process checkpoints
only its own shards (the concatenation of its ranks' shards, in rank order) and records which ranks they are:

    local, ranks = local_shards(page)                  # numpy; this process's ranks, ascending
    page = from_local(local, ranks, total_ranks, sharding)    # the global jax.Array again (the same ranks)
    whole = assemble([(local0, ranks0), (local1, ranks1)], total_ranks)   # numpy: every shard, end to end

`ShardMeta` is what a process's checkpoint says about its shards; a checkpoint of every process together is
assembled into whole pages (`assemble`) when it is resumed by another set of processes. `ProcessShards` is the
page store's view: what of a page this process keeps where no other process can read it (its disk files).

Underneath, and for arrays sharded any way (the in-memory engine's leaves under mesh.fsdp): a process's distinct
*pieces* of an array by index (`local_pieces`), the array again from them (`from_pieces`), and a whole array from
every process's pieces (`assemble_pieces`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import jax
import numpy as np


# ------------------------------------------------------------------------------------ pieces of any sharded array

Index = tuple[tuple[int, int], ...]
"""Where a piece of an array lies: (start, stop) along every dimension."""


def index_of(index: tuple[slice, ...], shape: tuple[int, ...]) -> Index:
    """A shard's index (slices, possibly open) as (start, stop) per dimension of an array of `shape`."""
    return tuple((s.start or 0, dim if s.stop is None else s.stop) for s, dim in zip(index, shape))


def local_pieces(a: jax.Array) -> list[tuple[Index, Any]]:
    """The distinct pieces of a sharded array this process holds (a piece replicated on several of its devices
    once), in a fixed order: (index, the piece as a single-device jax.Array)."""
    pieces: dict[Index, Any] = {}
    for shard in a.addressable_shards:
        pieces.setdefault(index_of(shard.index, a.shape), shard.data)
    return sorted(pieces.items())


def from_pieces(shape: tuple[int, ...], sharding: jax.sharding.Sharding, pieces: Mapping[Index, np.ndarray]
                ) -> jax.Array:
    """The array of `shape` laid out by `sharding` whose pieces on this process's devices are `pieces`."""
    def part(index: tuple[slice, ...]) -> np.ndarray:
        key = index_of(index, shape)
        if key not in pieces:
            raise ValueError(f"no piece {[list(k) for k in key]} of an array of shape {list(shape)} in this process's "
                             f"checkpoint (it holds {[[list(k) for k in p] for p in pieces]})")
        return np.array(pieces[key])  # a copy: the CPU client may alias a numpy buffer

    return jax.make_array_from_callback(tuple(shape), sharding, part)


def assemble_pieces(shape: tuple[int, ...], dtype: Any, pieces: Sequence[tuple[Index, np.ndarray]]) -> np.ndarray:
    """A whole array from pieces of it (every process's; a piece may come more than once, from processes that
    both held it): refused unless they cover it."""
    out = np.empty(shape, dtype)
    seen: set[Index] = set()
    covered = 0
    for index, piece in pieces:
        if index in seen:
            continue
        seen.add(index)
        region = tuple(slice(a, b) for a, b in index)
        out[region] = piece
        covered += int(np.prod([b - a for a, b in index], dtype=np.int64))
    if covered != int(np.prod(shape, dtype=np.int64)):
        raise ValueError(f"the pieces cover {covered} of the {int(np.prod(shape, dtype=np.int64))} elements of an "
                         f"array of shape {list(shape)}: some process's pieces are missing")
    return out


# ------------------------------------------------------------------------ rank shards of 1-D pages (ZeRO-3)

@dataclass(frozen=True)
class ShardMeta:
    """Which shards of every page a process's checkpoint holds."""

    process: int
    """The process that wrote it."""
    processes: int
    """Processes of the run that wrote it: a checkpoint of the state is all of theirs together."""
    ranks: tuple[int, ...]
    """Ranks (positions along the sharded axis) whose shards it holds, ascending, each 1/`total_ranks` of a page."""
    total_ranks: int

    def to_dict(self) -> dict[str, Any]:
        return {"process": self.process, "processes": self.processes, "ranks": list(self.ranks),
                "total_ranks": self.total_ranks}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> "ShardMeta":
        try:
            meta = ShardMeta(int(d["process"]), int(d["processes"]), tuple(int(r) for r in d["ranks"]),
                             int(d["total_ranks"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"a shard checkpoint's description is malformed ({d!r}): {e}") from None
        if not meta.ranks or list(meta.ranks) != sorted(set(meta.ranks)) or \
                not all(0 <= r < meta.total_ranks for r in meta.ranks):
            raise ValueError(f"a shard checkpoint's ranks {list(meta.ranks)} are not distinct ranks of "
                             f"0..{meta.total_ranks - 1} in ascending order")
        return meta


def local_shards(page: jax.Array) -> tuple[np.ndarray, tuple[int, ...]]:
    """This process's shards of a 1-D page sharded evenly over its axis: their concatenation in rank order (a new
    numpy array) and the ranks."""
    pieces = local_pieces(page)
    n = pieces[0][1].shape[0]
    return np.concatenate([np.asarray(p) for _, p in pieces]), tuple(start // n for ((start, _),), _ in pieces)


def _cut(local: np.ndarray, ranks: Sequence[int]) -> dict[int, np.ndarray]:
    """rank -> its shard, of a process's concatenated shards."""
    if not ranks or local.ndim != 1 or local.shape[0] % len(ranks):
        raise ValueError(f"{local.shape} elements do not split into the shards of ranks {list(ranks)}")
    n = local.shape[0] // len(ranks)
    return {r: local[k * n:(k + 1) * n] for k, r in enumerate(ranks)}


def from_local(local: np.ndarray, ranks: Sequence[int], total_ranks: int,
               sharding: jax.sharding.Sharding) -> jax.Array:
    """The global page (`total_ranks` shards end to end) whose shards on this process's ranks are `local` (as
    `local_shards` gave them), laid out by `sharding` (the page store tier's)."""
    n = local.shape[0] // max(len(ranks), 1)
    return from_pieces((n * total_ranks,), sharding, {((r * n, (r + 1) * n),): shard
                                                       for r, shard in _cut(local, ranks).items()})


def assemble(parts: Sequence[tuple[np.ndarray, Sequence[int]]], total_ranks: int) -> np.ndarray:
    """A whole page from every process's shards of it ((local, ranks) per process), `total_ranks` shards."""
    covered: dict[int, np.ndarray] = {}
    for local, ranks in parts:
        for r, shard in _cut(np.asarray(local), ranks).items():
            if r in covered:
                raise ValueError(f"rank {r}'s shard is in two processes' checkpoints")
            covered[r] = shard
    missing = sorted(set(range(total_ranks)) - set(covered))
    if missing or len(covered) != total_ranks:
        raise ValueError(f"the shards of ranks {missing or sorted(set(covered) - set(range(total_ranks)))} are "
                         f"{'missing' if missing else 'not ranks of this page'}: a page is {total_ranks} shards")
    return np.concatenate([covered[r] for r in range(total_ranks)])


@dataclass(frozen=True)
class ProcessShards:
    """This process's ranks of pages laid out by a sharding over the devices of several processes."""

    ranks: tuple[int, ...]
    """Positions of this process's devices along the sharded axis, ascending."""
    total: int
    """Ranks in all (a page is `total` shards)."""

    @staticmethod
    def of(sharding: jax.sharding.Sharding) -> "ProcessShards | None":
        """None unless `sharding` (a 1-D mesh's) spans several processes."""
        mesh = getattr(sharding, "mesh", None)
        devices = list(mesh.devices.flat) if mesh is not None else []
        if len({d.process_index for d in devices}) < 2:
            return None
        me = jax.process_index()
        return ProcessShards(tuple(r for r, d in enumerate(devices) if d.process_index == me), len(devices))

    def length(self, whole: int) -> int:
        """Elements of this process's part of a page of `whole` elements."""
        return whole // self.total * len(self.ranks)

    def local(self, page: jax.Array | np.ndarray) -> np.ndarray:
        """This process's part of a page: of a global jax.Array its addressable shards, of a whole numpy page
        (the same on every process) its ranks' slices."""
        if isinstance(page, jax.Array) and not page.is_fully_addressable:
            data, ranks = local_shards(page)
            if ranks != self.ranks:
                raise ValueError(f"the page's shards here are ranks {list(ranks)}, not {list(self.ranks)}")
            return data
        whole = np.asarray(page)
        n = whole.shape[0] // self.total
        return np.concatenate([whole[r * n:(r + 1) * n] for r in self.ranks])

    def page(self, local: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
        """The global page whose part on this process is `local`."""
        return from_local(local, self.ranks, self.total, sharding)
