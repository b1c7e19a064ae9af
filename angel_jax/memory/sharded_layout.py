"""ShardedPageLayout: ZeRO-3 pages, every leaf of a stage split evenly over N ranks.

Each rank holds 1/N of every leaf: the leaf flattened, zero-padded to a multiple of N elements and cut into N
equal chunks, chunk r on rank r. A rank's chunks are packed into pages by an ordinary `PageLayout` (the *rank
layout*, built from the chunks' shapes), so every rank has the same pages, each 1/N of the stage. The *global* page
k is the concatenation of the N ranks' page k: an array of N x L elements sharded over the ranks, rank r's shard
being its own page. That global page is what the page store holds (a jax.Array laid out over the mesh), what a
checkpoint saves, and what this layout's `pack` and `unpack` produce and read: it stands in for a `PageLayout`
wherever whole pages are handled (initialisation, checkpoints, reading parameters back), while compute works on
each rank's shard (`angel_jax/schedule/zero.py`).

Why flat chunks rather than one sharded dimension per leaf: every leaf splits evenly whatever its shape, so every
byte of state is 1/N per rank (no replicated leftovers whose gradient norms would be counted N times), and the
optimizer, which is elementwise, updates a rank's chunks without seeing the leaf's shape. The padding is zero and
stays zero under elementwise optimizers (a zero gradient on a zero parameter gives a zero update; weight decay of
zero is zero); optimizers that need a leaf's shape (Adafactor's factored moments) are refused by the engine.

    layout = ShardedPageLayout.build([("embed", tree), ...], page_size, ranks=4)
    pages = layout.stage("embed").pack(tree)       # global pages (numpy), N x L elements each
    tree_again = layout.stage("embed").unpack(pages)
    rank_pages = layout.stage("embed").rank.pack(chunks(tree, 4, r))   # rank r's own pages
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from angel_jax.memory.layout import PageLayout, PageSpec, PageViews, StageLayout, StagesByName, page_groups, to_values

PyTree = Any


def chunk_size(size: int, ranks: int) -> int:
    """Elements of one rank's chunk of a leaf of `size` elements (the leaf padded to ranks x this)."""
    return -(-size // ranks)


def chunk_shapes(tree: PyTree, ranks: int) -> PyTree:
    """The tree of one rank's chunks: each leaf a flat `chunk_size` ShapeDtypeStruct of the leaf's dtype."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct((chunk_size(int(np.prod(a.shape)), ranks),), a.dtype), tree)


def chunks(tree: PyTree, ranks: int, rank: int) -> PyTree:
    """Rank `rank`'s chunk of every leaf of `tree` (numpy in, numpy out)."""
    def cut(a: Any) -> np.ndarray:
        flat = np.asarray(a).reshape(-1)
        c = chunk_size(flat.size, ranks)
        padded = np.zeros(c * ranks, flat.dtype)
        padded[:flat.size] = flat
        return padded[rank * c:(rank + 1) * c].copy()

    return jax.tree.map(cut, tree)


@dataclass(frozen=True)
class ShardedStageLayout(PageViews):
    """One stage's global pages: `rank` lays out one rank's chunks; the global page k is N x rank page k."""

    rank: StageLayout
    full: tuple[tuple[tuple[int, ...], np.dtype], ...]
    """Per leaf (tree_flatten order): the leaf's whole shape and dtype."""
    ranks: int
    pages: tuple[PageSpec, ...]
    """The global pages (ids as the rank layout's, N x its lengths)."""

    @property
    def name(self) -> str:
        return self.rank.name

    @property
    def treedef(self) -> Any:
        return self.rank.treedef

    @property
    def page_ids(self) -> tuple[int, ...]:
        return self.rank.page_ids

    @property
    def nbytes(self) -> int:
        return self.ranks * self.rank.nbytes

    @property
    def waste_bytes(self) -> int:
        return self.ranks * self.rank.waste_bytes

    def pack(self, tree: PyTree) -> tuple:
        """The stage's whole pytree (numpy) -> its global pages (numpy): every rank's pages, concatenated."""
        per_rank = [self.rank.pack(chunks(tree, self.ranks, r)) for r in range(self.ranks)]
        return tuple(np.concatenate([pages[k] for pages in per_rank]) for k in range(len(self.pages)))

    @property
    def keeps_apart(self) -> bool:
        """Whether this stage's apart pages (expert weights, `PageLayout.build(apart=...)`) stay on their rank:
        each apart leaf's first axis (its experts) divides evenly over the ranks, so rank r's chunk of it is whole
        rows of it, r x E/N to (r + 1) x E/N: rank r's own experts, which it computes with and updates without
        any gather or reduce-scatter (expert parallelism, schedule/zero.py)."""
        shapes = [shape for slot, (shape, _) in zip(self.rank.slots, self.full) if self._apart(slot)]
        return bool(shapes) and all(len(s) > 0 and s[0] % self.ranks == 0 for s in shapes)

    def _apart(self, slot: Any) -> bool:
        first = self.rank.pages[0].id
        return slot.size > 0 and self.rank.pages[slot.page - first].apart

    def local(self, page: PageSpec) -> bool:
        """Whether a rank's call sees its own shard of `page` rather than the whole page (see `keeps_apart`)."""
        return page.apart and self.keeps_apart

    def unpack(self, pages: Sequence, local: bool = False) -> PyTree:
        """Global pages (numpy, or jax arrays of N x L elements) -> the stage's whole pytree. Slices, reshapes and
        concatenations only: under jit on gathered pages XLA fuses them into the stage. `local` (inside a rank's
        call): the pages `self.local` names are the rank's own (L elements) and their leaves come back as the
        rank's rows of them, [E/N, ...]."""
        pages = [page.view(spec.bits) if isinstance(page, np.ndarray) and page.dtype == spec.dtype else page
                 for page, spec in zip(pages, self.pages)]  # a checkpoint's arrays, typed as their values
        xp = np if all(isinstance(p, np.ndarray) for p in pages) else jnp
        first = self.rank.pages[0].id if self.rank.pages else 0
        own = [local and self.local(spec) for spec in self.rank.pages]
        rows = [xp.reshape(p, (1 if o else self.ranks, -1)) for p, o in zip(pages, own)]  # row r: rank r's page
        leaves = []
        for slot, (shape, dtype) in zip(self.rank.slots, self.full):
            size = int(np.prod(shape))
            if slot.size == 0:
                leaves.append(xp.zeros(shape, dtype))
                continue
            length = self.rank.pages[slot.page - first].length
            parts = [rows[pid - first][:, a:b] for pid, a, b in slot.spans(length)]
            block = parts[0] if len(parts) == 1 else xp.concatenate(parts, axis=1)  # [ranks, chunk]
            block = to_values(block, dtype)
            if own[slot.page - first]:
                leaves.append(xp.reshape(block, (shape[0] // self.ranks,) + tuple(shape[1:])))
            else:
                leaves.append(xp.reshape(xp.reshape(block, (-1,))[:size], shape))
        return jax.tree_util.tree_unflatten(self.rank.treedef, leaves)

    def scatter_rows(self, tree: PyTree, local: bool = False) -> tuple:
        """The stage's whole pytree (jax, under jit) -> per page a [ranks, L] array whose row r is what rank r's
        page k would hold, as values (gradients, summed by the reduce-scatter before they become bits): the
        inverse of `unpack`, the input of a reduce-scatter over the ranks. `local`: as in
        `unpack`, the leaves of the pages `self.local` names are the rank's rows, and their pages come back as the
        rank's own [L]."""
        leaves = jax.tree_util.tree_leaves(tree)
        out: list = []
        for group in page_groups(self.rank.pages):
            length, own = group[0].length, local and self.local(group[0])
            ranks = 1 if own else self.ranks
            parts = []
            for slot, leaf in zip(self.rank.slots, leaves):
                if slot.size == 0 or not (group[0].id <= slot.page <= group[-1].id):
                    continue
                flat = jnp.reshape(leaf, (-1,)).astype(slot.dtype)
                flat = jnp.pad(flat, (0, slot.size * ranks - flat.size))
                parts.append(jnp.reshape(flat, (ranks, slot.size)))
            used = sum(p.shape[1] for p in parts)
            pad = len(group) * length - used
            if pad:
                parts.append(jnp.zeros((ranks, pad), group[0].dtype))
            rows = jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
            out.extend(rows[0, k * length:(k + 1) * length] if own else rows[:, k * length:(k + 1) * length]
                       for k in range(len(group)))
        return tuple(out)


@dataclass(frozen=True)
class ShardedPageLayout(StagesByName):
    """Every stage's global pages over `ranks` ranks; a `PageLayout` stand-in (ids, specs, pack and unpack)."""

    rank_layout: PageLayout
    stages: tuple[ShardedStageLayout, ...]
    ranks: int

    @staticmethod
    def build(stages: Iterable[tuple[str, PyTree]], page_size_bytes: int, ranks: int,
              apart: Callable[[str, str], bool] | None = None) -> "ShardedPageLayout":
        """`apart`: as `PageLayout.build`'s, for the rank layout (whose leaves have the same paths)."""
        stages = [(name, jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree))
                  for name, tree in stages]
        rank_layout = PageLayout.build([(name, chunk_shapes(tree, ranks)) for name, tree in stages], page_size_bytes,
                                       apart)
        out = []
        for (name, tree), rank in zip(stages, rank_layout.stages):
            full = tuple((tuple(a.shape), np.dtype(a.dtype)) for a in jax.tree_util.tree_leaves(tree))
            pages = tuple(replace(p, length=p.length * ranks, used=p.used * ranks) for p in rank.pages)
            out.append(ShardedStageLayout(rank, full, ranks, pages))
        return ShardedPageLayout(rank_layout, tuple(out), ranks)

    @property
    def page_size_bytes(self) -> int:
        return self.rank_layout.page_size_bytes * self.ranks

    @property
    def num_pages(self) -> int:
        return self.rank_layout.num_pages

    def page(self, page_id: int) -> PageSpec:
        return self.pages[page_id]

    def pack(self, stage: str, tree: PyTree) -> tuple:
        return self.stage(stage).pack(tree)

    def unpack(self, stage: str, pages: Sequence) -> PyTree:
        return self.stage(stage).unpack(pages)

    @property
    def total_bytes(self) -> int:
        return self.ranks * self.rank_layout.total_bytes


def stage_shapes(layout: PageLayout | ShardedPageLayout) -> list[tuple[str, PyTree]]:
    """Each stage's leaves as whole-leaf ShapeDtypeStructs in the stage's structure: what `layout` was built
    from, so that a layout of the same leaves over another number of ranks can be built from it."""
    out = []
    for stage in layout.stages:
        if isinstance(stage, ShardedStageLayout):
            leaves = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in stage.full]
        else:
            leaves = [jax.ShapeDtypeStruct(slot.shape, slot.dtype) for slot in stage.slots]
        out.append((stage.name, jax.tree_util.tree_unflatten(stage.treedef, leaves)))
    return out


def apart_paths(layout: PageLayout | ShardedPageLayout) -> Callable[[str, str], bool] | None:
    """The `apart` of `layout`'s build, read back from its pages: (stage, path) of the leaves on apart pages."""
    paths = set()
    for stage in layout.stages:
        rank = stage.rank if isinstance(stage, ShardedStageLayout) else stage
        first = rank.pages[0].id if rank.pages else 0
        paths |= {(stage.name, slot.path) for slot in rank.slots
                  if slot.size and rank.pages[slot.page - first].apart}
    return (lambda stage, path: (stage, path) in paths) if paths else None


def layout_over(layout: PageLayout | ShardedPageLayout, ranks: int) -> PageLayout | ShardedPageLayout:
    """The layout of `layout`'s leaves, with its page size per rank and its apart leaves, over `ranks` ranks: a
    plain `PageLayout` for one (pages hold the leaves end to end, as an engine on one device lays them out), else
    sharded. A checkpoint written over another number of ranks is read back with it."""
    page_size = layout.rank_layout.page_size_bytes if isinstance(layout, ShardedPageLayout) else \
        layout.page_size_bytes
    if ranks == 1:
        return PageLayout.build(stage_shapes(layout), page_size, apart_paths(layout))
    return ShardedPageLayout.build(stage_shapes(layout), page_size, ranks, apart_paths(layout))
