"""PageLayout: the leaves of each stage's state pytree packed into fixed-size, single-dtype flat pages.

Built once, from abstract shapes, from a list of (stage name, pytree) in access order:

    layout = PageLayout.build([("embed", embed_params), ("block.0", b0), ...], page_size_bytes=64 * 2**20)
    pages = layout.pack("block.0", b0)          # tuple of 1-D arrays, one per page of the stage
    b0_again = layout.unpack("block.0", pages)  # the same pytree, bit for bit

Rules:
- A page holds one dtype; every page of a dtype has `page_size_bytes // itemsize` elements, so every page is
  `page_size_bytes` long (the size must be a multiple of each itemsize it holds).
- Pages never mix stages: a stage's pages hold its own leaves alone (`layout.stage(name).page_ids`). Within a
  stage, leaves are grouped by dtype (groups in order of first appearance, leaves in `tree_flatten` order) and laid
  end to end: small leaves share a page, a leaf larger than what is left spans consecutive pages. The tail of each
  group's last page is zero padding, reported as `waste_bytes` / `waste_fraction`. Leaves the caller sets apart
  (`build(apart=...)`: a mixture of experts' expert weights) form groups of their own after the others, so they sit
  on pages of their own, which a sharded layout can keep on their rank and a plan can count apart.
- Page ids are global and follow access order: stage 0's pages first.
- A page is stored as its bits: an unsigned-integer array of its dtype's width (`PageSpec.bits`: uint16 for
  bfloat16, uint32 for float32, uint8 for bool). No program that moves pages (pack, unpack, tier moves, gathers,
  checkpoint copies) takes or returns a float-typed page: XLA's CPU backend, on a processor without native
  bfloat16, moves a bfloat16-typed array through float32 and quiets NaN payloads (0xffcc -> 0xffc0), so whether
  a float page kept its bits would depend on the processor. The float view of a page exists only inside compute
  (`StageLayout.values`, and the leaves `unpack` gives): a stage function, an optimizer update.
- `pack`/`unpack` are pure (concatenation or writes into zeros, slice, reshape, bitcast) and work eagerly on
  numpy (numpy in, numpy out), eagerly on jax arrays, and under `jax.jit` with the layout static, where XLA fuses
  them into the stage. `unpack` also takes numpy pages typed as their values (a checkpoint's arrays): a numpy
  view is exact.

This module knows nothing about tiers or models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any

DEFAULT_PAGE_SIZE = 64 * 2**20
FIT_ALIGN = 64 * 2**10
"""`fit_page_size` rounds to this: a multiple of every item size, and of the 4 KiB direct I/O wants."""


@dataclass(frozen=True)
class LeafSlot:
    """Where one leaf lives: elements [offset, offset + size) of the concatenation of pages page, page+1, ..."""

    stage: str
    path: str
    """`jax.tree_util.keystr` of the leaf inside its stage's pytree."""
    shape: tuple[int, ...]
    dtype: np.dtype
    page: int
    """Global id of the first page holding the leaf; -1 for an empty leaf (size 0), which occupies no page."""
    offset: int
    """Element offset of the leaf's first element within `page`."""
    size: int
    """Number of elements."""

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def spans(self, page_len: int) -> list[tuple[int, int, int]]:
        """(page id, start, stop) element ranges that make up the leaf, in order."""
        out, page, start, left = [], self.page, self.offset, self.size
        while left > 0:
            n = min(left, page_len - start)
            out.append((page, start, start + n))
            page, start, left = page + 1, 0, left - n
        return out


@dataclass(frozen=True)
class PageSpec:
    """One page: a 1-D array of `length` elements of `dtype`, of which the first `used` carry data."""

    id: int
    stage: str
    dtype: np.dtype
    length: int
    used: int
    apart: bool = False
    """Whether the page holds leaves set apart on pages of their own (`PageLayout.build(apart=...)`): a mixture of
    experts' stacked expert weights, which a sharded layout may keep on their rank instead of gathering them."""

    @property
    def nbytes(self) -> int:
        return self.length * self.dtype.itemsize

    @property
    def waste_bytes(self) -> int:
        return (self.length - self.used) * self.dtype.itemsize

    @property
    def bits(self) -> np.dtype:
        """The dtype the page is stored as: the unsigned integer of `dtype`'s width (module docstring)."""
        return bits_dtype(self.dtype)

    @property
    def abstract(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((self.length,), self.bits)


class PageViews:
    """The value view of a stage's pages held as bits, and back (a stage layout's `pages` give the dtypes)."""

    pages: tuple

    def values(self, pages: Sequence) -> tuple:
        """The float (value) view of pages held as bits: for arithmetic on whole pages inside compute (a
        gradient's sum of squares, accumulation, a flat optimizer update). Bitcasts only."""
        return tuple(to_values(p, spec.dtype) for p, spec in zip(pages, self.pages))

    def bits(self, pages: Sequence) -> tuple:
        """Pages computed as values, as the bits they are stored as (the inverse of `values`)."""
        return tuple(to_bits(p) for p in pages)


@dataclass(frozen=True)
class StageLayout(PageViews):
    """The pages of one stage and how its pytree maps onto them."""

    name: str
    treedef: Any
    slots: tuple[LeafSlot, ...]
    """One per leaf, in `tree_flatten` order."""
    pages: tuple[PageSpec, ...]
    """The stage's pages in order; ids are consecutive."""

    @property
    def page_ids(self) -> tuple[int, ...]:
        return tuple(p.id for p in self.pages)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pages)

    @property
    def waste_bytes(self) -> int:
        return sum(p.waste_bytes for p in self.pages)

    def apart_splits(self, ranks: int) -> bool:
        """Whether the stage has leaves set apart and each one's first axis divides evenly over `ranks` (whole
        experts per rank: the condition of expert parallelism, `ShardedStageLayout.keeps_apart`)."""
        first = self.pages[0].id if self.pages else 0
        shapes = [slot.shape for slot in self.slots if slot.size and self.pages[slot.page - first].apart]
        return bool(shapes) and all(len(shape) > 0 and shape[0] % ranks == 0 for shape in shapes)

    def pack(self, tree: PyTree) -> tuple:
        """The stage's pytree -> tuple of pages, as bits (numpy if every leaf is numpy, else jax arrays)."""
        leaves = self._checked_leaves(tree)
        xp = np if all(isinstance(x, np.ndarray) for x in leaves) else jnp
        out: list = []
        for group in self._groups():
            first = self.pages[group[0].id - self.pages[0].id]
            parts = [to_bits(xp.reshape(leaves[i], (-1,)))
                     for i, s in enumerate(self.slots) if _in_group(s, group)]
            length = len(group) * first.length
            if any(isinstance(part, jax.core.Tracer) for part in parts):  # under jit: see `written_page`
                flat = written_page(parts, length, first.bits)
            else:  # (eagerly, each write would copy the whole page: one concatenation instead)
                pad = length - sum(p.used for p in group)
                # (copies even a single part: pages never alias the caller's leaves)
                flat = xp.concatenate(parts + ([xp.zeros((pad,), first.bits)] if pad else []))
            out.extend(flat[k * first.length:(k + 1) * first.length] for k in range(len(group)))
        return tuple(out)

    def unpack(self, pages: Sequence) -> PyTree:
        """Tuple of pages -> the stage's pytree. Only slices and reshapes: XLA fuses them under jit."""
        if len(pages) != len(self.pages):
            raise ValueError(f"stage {self.name!r}: expected {len(self.pages)} pages, got {len(pages)}")
        first_id = self.pages[0].id if self.pages else 0
        pages = [_as_stored(page, spec, self.name) for spec, page in zip(self.pages, pages)]
        xp = np if all(isinstance(p, np.ndarray) for p in pages) else jnp
        leaves = []
        for slot in self.slots:
            if slot.size == 0:
                leaves.append(xp.zeros(slot.shape, slot.dtype))
                continue
            length = self.pages[slot.page - first_id].length
            parts = [pages[pid - first_id][a:b] for pid, a, b in slot.spans(length)]
            flat = xp.concatenate(parts)  # a fresh buffer: leaves never alias the pages
            leaves.append(xp.reshape(to_values(flat, slot.dtype), slot.shape))
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def _groups(self) -> list[list[PageSpec]]:
        return page_groups(self.pages)

    def _checked_leaves(self, tree: PyTree) -> list:
        paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
        if treedef != self.treedef:
            raise ValueError(f"stage {self.name!r}: pytree structure differs from the layout's:\n"
                             f"  layout: {self.treedef}\n  given:  {treedef}")
        leaves = []
        for (path, leaf), slot in zip(paths_leaves, self.slots):
            dtype = getattr(leaf, "dtype", None)
            shape, dtype = tuple(np.shape(leaf)), np.dtype(np.asarray(leaf).dtype if dtype is None else dtype)
            if shape != slot.shape or dtype != slot.dtype:
                raise ValueError(f"stage {self.name!r}: leaf {slot.path} must be {slot.dtype}{list(slot.shape)}, "
                                 f"got {dtype}{list(shape)}")
            leaves.append(leaf)
        return leaves


def written_page(parts: Sequence, length: int, dtype: Any) -> jax.Array:
    """`parts` (1-D jax arrays of `dtype`) laid end to end from the start of a zero buffer of `length`, each
    written into it in place (under jit).

    Not one concatenation of the parts and a zero tail, nor a pad (XLA rewrites writes into a plain zero buffer to
    a pad, hence the barrier around the zeros): XLA's CPU backend fuses either into what reads the page (a
    backward's sum of squares over its gradient pages) as a slow loop. Measured on a 2-core VM (jax 0.11.2), for a
    7 MB page mostly of padding: 7-77 ms, depending on the compilation, against 0.1-0.4 ms for the writes in every
    compilation. The head's backward in experiments/bench/paged_step.py took 102 ms, now 3 ms."""
    flat = jax.lax.optimization_barrier(jnp.zeros((length,), dtype))
    offset = 0
    for part in parts:
        flat = jax.lax.dynamic_update_slice(flat, part, (offset,))
        offset += part.shape[0]
    return flat


def bits_dtype(dtype: Any) -> np.dtype:
    """The unsigned integer of `dtype`'s width: what a page of `dtype` is stored as."""
    return np.dtype(f"u{np.dtype(dtype).itemsize}")


def to_bits(x: Any) -> Any:
    """An array as the unsigned integers of its width, bit for bit (a numpy view; a bitcast under jax, which XLA
    makes free). Unsigned arrays come back as they are."""
    dtype = np.dtype(x.dtype)
    if dtype.kind == "u":
        return x
    if isinstance(x, np.ndarray):
        return x.view(bits_dtype(dtype))
    if dtype == np.bool_:  # lax has no bitcast for booleans; a bool's byte is 0 or 1
        return x.astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(x, bits_dtype(dtype))


def to_values(x: Any, dtype: Any) -> Any:
    """Bits (`to_bits`) back as an array of `dtype`, bit for bit."""
    dtype = np.dtype(dtype)
    if np.dtype(x.dtype) == dtype:
        return x
    if isinstance(x, np.ndarray):
        return x.view(dtype)
    if dtype == np.bool_:
        return x != 0
    return jax.lax.bitcast_convert_type(x, dtype)


def _as_stored(page: Any, spec: "PageSpec", stage: str) -> Any:
    """A page as `unpack` reads it: its bits. A numpy page typed as its values (an array of a checkpoint) is
    viewed as its bits; any other dtype or shape is an error that names the page."""
    dtype = np.dtype(page.dtype)
    if isinstance(page, np.ndarray) and dtype == spec.dtype and tuple(page.shape) == (spec.length,):
        return page.view(spec.bits)
    if tuple(page.shape) != (spec.length,) or dtype != spec.bits:
        raise ValueError(f"stage {stage!r}: page {spec.id} must be {spec.bits}[{spec.length}] (the bits of its "
                         f"{spec.dtype} values), got {dtype}{list(page.shape)}")
    return page


def page_groups(pages: Sequence[PageSpec]) -> list[list[PageSpec]]:
    """A stage's pages split into their groups: runs of one dtype, set apart or not, whose leaves lie end to end."""
    groups: list[list[PageSpec]] = []
    for p in pages:
        if groups and (groups[-1][0].dtype, groups[-1][0].apart) == (p.dtype, p.apart):
            groups[-1].append(p)
        else:
            groups.append([p])
    return groups


def _in_group(slot: LeafSlot, group: list[PageSpec]) -> bool:
    return slot.size > 0 and slot.dtype == group[0].dtype and group[0].id <= slot.page <= group[-1].id


class StagesByName:
    """A layout's stages looked up by name (`PageLayout`, and the sharded one of sharded_layout.py)."""

    stages: tuple

    @property
    def stage_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.stages)

    def stage(self, name: str) -> Any:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(f"no stage {name!r} in the layout (stages: {', '.join(self.stage_names)})")

    @property
    def pages(self) -> tuple[PageSpec, ...]:
        return tuple(p for s in self.stages for p in s.pages)


@dataclass(frozen=True)
class PageLayout(StagesByName):
    """Pages of every stage, in access order. Immutable and hashable (usable as a static jit argument)."""

    page_size_bytes: int
    stages: tuple[StageLayout, ...]

    @staticmethod
    def build(stages: Iterable[tuple[str, PyTree]], page_size_bytes: int = DEFAULT_PAGE_SIZE,
              apart: Callable[[str, str], bool] | None = None) -> "PageLayout":
        """Lay out `(stage name, pytree)` pairs in the order given. Leaves need only `.shape` and `.dtype`
        (arrays or `jax.ShapeDtypeStruct`). `apart`: given a stage's name and a leaf's path in it (`keystr`),
        whether the leaf goes on pages of its own, apart from the stage's other leaves of its dtype (their group
        follows theirs)."""
        if page_size_bytes <= 0:
            raise ValueError(f"page_size_bytes must be positive, got {page_size_bytes}")
        built: list[StageLayout] = []
        next_id = 0
        for name, tree in stages:
            if any(s.name == name for s in built):
                raise ValueError(f"stage name {name!r} appears twice")
            stage = _layout_stage(name, tree, page_size_bytes, next_id, apart)
            next_id += len(stage.pages)
            built.append(stage)
        return PageLayout(page_size_bytes, tuple(built))

    @property
    def num_pages(self) -> int:
        return sum(len(s.pages) for s in self.stages)

    def page(self, page_id: int) -> PageSpec:
        for s in self.stages:
            if s.pages and s.pages[0].id <= page_id <= s.pages[-1].id:
                return s.pages[page_id - s.pages[0].id]
        raise KeyError(f"no page {page_id} in the layout ({self.num_pages} pages)")

    def pack(self, stage: str, tree: PyTree) -> tuple:
        return self.stage(stage).pack(tree)

    def unpack(self, stage: str, pages: Sequence) -> PyTree:
        return self.stage(stage).unpack(pages)

    @property
    def total_bytes(self) -> int:
        """Bytes of all pages, padding included."""
        return sum(s.nbytes for s in self.stages)

    @property
    def data_bytes(self) -> int:
        """Bytes of the leaves themselves."""
        return self.total_bytes - self.waste_bytes

    @property
    def waste_bytes(self) -> int:
        """Padding bytes: the unused tails of each (stage, dtype) group's last page."""
        return sum(s.waste_bytes for s in self.stages)

    @property
    def waste_fraction(self) -> float:
        return self.waste_bytes / self.total_bytes if self.total_bytes else 0.0

    def fitted_page_size(self, smallest: int = 4096) -> int:
        """The smallest power-of-two page size (at least `smallest`) on which the largest stage's leaves of one
        dtype fit one page: what a model much smaller than its pages could use instead, its padding then at most
        a page per stage and dtype, of its own size."""
        groups: dict[tuple[str, np.dtype, bool], int] = {}  # the bytes of each (stage, dtype, apart) group
        for stage in self.stages:
            for page in stage.pages:
                key = (stage.name, page.dtype, page.apart)
                groups[key] = groups.get(key, 0) + page.used * page.dtype.itemsize
        largest = max(groups.values(), default=1)
        return max(smallest, 1 << (largest - 1).bit_length())

    def summary(self) -> dict:
        return {"page_size_bytes": self.page_size_bytes, "num_pages": self.num_pages,
                "total_bytes": self.total_bytes, "data_bytes": self.data_bytes,
                "waste_bytes": self.waste_bytes, "waste_fraction": self.waste_fraction,
                "stages": {s.name: {"pages": list(s.page_ids), "bytes": s.nbytes, "waste_bytes": s.waste_bytes}
                           for s in self.stages}}


def _leaf_dtype(stage: str, path: str, leaf: Any) -> np.dtype:
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or not hasattr(leaf, "shape"):
        raise TypeError(f"stage {stage!r}: leaf {path} has no shape/dtype (got {type(leaf).__name__}); "
                        "pass arrays or jax.ShapeDtypeStruct")
    dtype = np.dtype(dtype)
    if jax.dtypes.canonicalize_dtype(dtype) != dtype:
        raise TypeError(f"stage {stage!r}: leaf {path} has dtype {dtype}, which jax would silently convert to "
                        f"{jax.dtypes.canonicalize_dtype(dtype)}; enable jax_enable_x64 or cast it first")
    return dtype


def fit_page_size(stages: Iterable[tuple[str, PyTree]], limit: int,
                  apart: Callable[[str, str], bool] | None = None, align: int = FIT_ALIGN) -> int:
    """The page size at most `limit` that pads the stages' pages least, with no more pages than `limit` gives
    (plus a quarter): a group of leaves of one dtype that needs k pages of `limit` goes on k pages of its own
    bytes / k instead (a 201 MB block on 4 pages of 50 MB, not on 4 of 64 MiB with a quarter of them padding).
    Candidates are `limit` and, for each group, its bytes / k rounded up to `align` (a multiple of every item
    size); the one whose pages hold the fewest bytes wins, the larger on a tie. A `limit` below `align` is kept."""
    if limit < align:
        return limit
    groups: dict[int, int] = {}  # group bytes -> how many groups have them
    for name, tree in stages:  # each (dtype, apart) group's bytes, as the stage's layout at `limit` groups them
        sizes: dict[tuple[np.dtype, bool], int] = {}
        for page in _layout_stage(name, tree, limit, 0, apart).pages:
            sizes[page.dtype, page.apart] = sizes.get((page.dtype, page.apart), 0) + page.used * page.dtype.itemsize
        for nbytes in sizes.values():
            groups[nbytes] = groups.get(nbytes, 0) + 1

    def pages(size: int) -> int:
        return sum(-(-g // size) * n for g, n in groups.items())

    most = pages(limit) + -(-pages(limit) // 4)

    def fitted(g: int) -> int:  # g bytes on as many pages as `limit` needs for them, rounded up to `align`
        per_page = -(-g // -(-g // limit))
        return min(limit, -(-per_page // align) * align)

    candidates = {limit} | {fitted(g) for g in groups}
    fits = [(pages(c) * c, -c) for c in candidates if pages(c) <= most]
    return -min(fits)[1]


def _layout_stage(name: str, tree: PyTree, page_size: int, first_id: int,
                  apart: Callable[[str, str], bool] | None = None) -> StageLayout:
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    info = []
    for path, leaf in paths_leaves:
        key = jax.tree_util.keystr(path)
        info.append((key, tuple(int(d) for d in leaf.shape) if hasattr(leaf, "shape") else (),
                     _leaf_dtype(name, key, leaf), bool(apart and apart(name, key))))
    groups = sorted(dict.fromkeys((dt, ap) for _, _, dt, ap in info), key=lambda g: g[1])  # shared ones first
    slots: dict[int, LeafSlot] = {}
    pages: list[PageSpec] = []
    for dt, ap in groups:
        if page_size % dt.itemsize:
            raise ValueError(f"page size {page_size} is not a multiple of the {dt} item size {dt.itemsize}")
        page_len = page_size // dt.itemsize
        pos = 0  # element position within the group
        group_first = first_id + len(pages)
        for i, (key, shape, ldt, lap) in enumerate(info):
            if (ldt, lap) != (dt, ap):
                continue
            size = int(np.prod(shape, dtype=np.int64))
            page = group_first + pos // page_len if size else -1
            slots[i] = LeafSlot(name, key, shape, dt, page, pos % page_len if size else 0, size)
            pos += size
        n_pages = -(-pos // page_len)
        for k in range(n_pages):
            used = min(page_len, pos - k * page_len)
            pages.append(PageSpec(group_first + k, name, dt, page_len, used, ap))
    return StageLayout(name, treedef, tuple(slots[i] for i in range(len(info))), tuple(pages))
