"""The stage update of an element-wise optimizer on the flat pages themselves, not on the unpacked leaves.

Why: the leaf-wise update (paged.py) slices each leaf out of its pages, runs optax per leaf and concatenates the
results back into pages. On the XLA CPU backend that is a dozen separate loops per leaf, each materialising its
intermediates (the clipped gradient, Adam's moments, the normalised update, the update itself, the selects), and
a concatenation per page: measured 4.6x the bytes the update needs (experiments/bench/host_optimizer.py). For an
optimizer that treats every element alike (AdamW, Adam, Lion, SGD with momentum: everything here but Adafactor)
the result does not depend on how the elements are grouped into leaves, so the update can run on a few long flat
*segments* instead: runs of elements that are contiguous in every page family at once (parameters, gradients and
each moment), cut where any family's page ends. With pages as large as the stage there is one segment per page.

    plan = FlatPlan.build(tx, params_rep, opt_rep, layout.paged)  # None: the layouts do not allow it
    update = make_flat_update(plan, tx, grad_clip, reduce)         # make_stage_update's arguments and results

It applies the same optax transformation to the segments, so its arithmetic is optax's: the leaf-wise update's
results element for element, up to the last bit XLA may round differently in differently fused loops (the tests
check 1e-6; a dropped update leaves every page bit for bit). Element-wise means no per-leaf choices either: a
weight-decay mask by leaf would be lost (the optimizers `make_optimizer` builds have none). What it needs from
the layouts, checked by `build`: the stage's parameters are one floating dtype laid end to end from the first
page's start of each page group (no zero-size or scalar leaves; an MoE layer's experts form a group of their
own, `PageLayout.build(apart=...)`, and the flat range runs group by group), and the optax state's paged leaves
are whole mirrors of the parameters (Adam's mu, nu), in the parameters' order, each family end to end in the
matching optimizer page group, all of one dtype. Page padding stays zero. Everything here is pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from angel_jax.memory.layout import StageLayout, page_groups, to_bits, to_values, written_page
from angel_jax.optim.factory import clip_with_norm

Pages = tuple


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of the stage's flat element range, found in page `page` (index within its family's
    pages) from element `offset` on."""

    page: int
    offset: int


@dataclass(frozen=True)
class FlatPlan:
    """How the flat element range [0, size) of a stage maps onto its pages, cut into segments."""

    size: int
    """Elements of the stage's parameters (padding excluded)."""
    bounds: tuple[tuple[int, int], ...]
    """The segments: (start, stop) element ranges, in order, covering [0, size)."""
    param_len: int
    """Elements per parameter page."""
    param_pages: int
    opt_len: int
    """Elements per optimizer page."""
    opt_pages: int
    families: int
    """Paged optimizer-state families (Adam: 2, mu and nu; SGD with momentum: 1; plain SGD: 0)."""
    state_treedef: Any
    """Tree structure of the optax state over a tuple of segments."""
    paged: tuple[bool, ...]
    """Per leaf of that state: whether it is one of the families' segments (else a small leaf, a step count)."""
    groups: tuple[tuple[int, int, int, int], ...] = ()
    """The stage's page groups (`memory.layout.page_groups`: leaves set apart, an MoE layer's experts, have pages
    of their own), in page order: (first element of the flat range, elements, first parameter page, first
    optimizer page). The flat range is the groups' leaves end to end, group by group; within a group the
    parameters, and each optimizer family after the other, lie end to end from the group's first page."""
    param_dtype: Any = None
    """The parameters' (and gradients') dtype: their pages are its bits (memory/layout.py)."""
    opt_dtype: Any = None
    """The optimizer pages' dtype (None without optimizer pages)."""

    @staticmethod
    def build(tx: optax.GradientTransformation, params_rep: StageLayout, opt_rep: StageLayout,
              opt_paged: tuple[bool, ...]) -> "FlatPlan | None":
        """The plan for a stage laid out as `params_rep`/`opt_rep` (optax state leaves paged as `opt_paged`,
        `OptLayout.paged`), or None where the layouts do not allow a flat update (then use the leaf-wise one)."""
        p_slots, p_pages = params_rep.slots, params_rep.pages
        if not p_slots or not p_pages or any(s.size == 0 or not s.shape for s in p_slots):
            return None
        dtype = p_slots[0].dtype
        if not jnp.issubdtype(dtype, jnp.floating) or any(p.dtype != dtype for p in p_pages):
            return None
        param_len, size = p_pages[0].length, sum(s.size for s in p_slots)
        p_groups = _leaf_groups(params_rep)
        if p_groups is None:
            return None
        # The optax state over the parameters: its paged leaves must be whole mirrors of the parameters.
        abstract = jax.tree.unflatten(params_rep.treedef,
                                      [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in p_slots])
        with_paths = jax.tree_util.tree_flatten_with_path(jax.eval_shape(tx.init, abstract))[0]
        if tuple(bool(getattr(leaf, "ndim", 0)) for _, leaf in with_paths) != tuple(opt_paged):
            return None
        big = [(path, leaf) for (path, leaf), p in zip(with_paths, opt_paged) if p]
        n = len(p_slots)
        if len(big) % n:
            return None
        families = len(big) // n
        for f in range(families):
            prefix = None
            for i, slot in enumerate(p_slots):
                path, leaf = big[f * n + i]
                key = jax.tree_util.keystr(path)
                if tuple(leaf.shape) != slot.shape or not key.endswith(slot.path):
                    return None
                here = key[:len(key) - len(slot.path)]
                if prefix not in (None, here):
                    return None
                prefix = here
        o_slots, o_pages = opt_rep.slots, opt_rep.pages
        opt_len = o_pages[0].length if o_pages else 1
        if len(o_slots) != len(big) or any(p.dtype != o_pages[0].dtype for p in o_pages) or \
                any(s.dtype != o_pages[0].dtype for s in o_slots):
            return None
        o_groups = _leaf_groups(opt_rep) if o_pages else [(0, [])] * len(p_groups)
        # Optimizer group g must hold, end to end, every family's mirror of parameter group g's leaves.
        if o_groups is None or len(o_groups) != len(p_groups):
            return None
        if families and any(o_leaves != [f * n + i for f in range(families) for i in p_leaves]
                            for (_, p_leaves), (_, o_leaves) in zip(p_groups, o_groups)):
            return None
        groups, cuts, start = [], {0, size}, 0
        for (p_page, p_leaves), (o_page, _) in zip(p_groups, o_groups):
            g_size = sum(p_slots[i].size for i in p_leaves)
            groups.append((start, g_size, p_page, o_page))
            cuts.update(range(start, start + g_size, param_len))  # parameter pages end (the group starts one)
            for f in range(families):  # family f: the group's opt elements [f x g_size, (f + 1) x g_size)
                first = -(-(f * g_size) // opt_len) * opt_len
                cuts.update(start + c - f * g_size for c in range(first, (f + 1) * g_size, opt_len))
            start += g_size
        edges = sorted(cuts)
        segments = tuple(zip(edges, edges[1:]))
        seg_params = tuple(jax.ShapeDtypeStruct((b - a,), dtype) for a, b in segments)
        seg_state = jax.eval_shape(tx.init, seg_params)
        seg_leaves, state_treedef = jax.tree.flatten(seg_state)
        paged = tuple(bool(getattr(leaf, "ndim", 0)) for leaf in seg_leaves)
        if sum(paged) != families * len(segments) or \
                [(leaf.shape, leaf.dtype) for leaf, p in zip(seg_leaves, paged) if not p] != \
                [(leaf.shape, leaf.dtype) for (_, leaf), p in zip(with_paths, opt_paged) if not p]:
            return None
        return FlatPlan(size, segments, param_len, len(p_pages), opt_len, len(o_pages), families, state_treedef,
                        paged, tuple(groups), dtype, o_pages[0].dtype if o_pages else None)

    def _group(self, a: int) -> tuple[int, int, int, int]:
        return next(g for g in self.groups if g[0] <= a < g[0] + g[1])

    def param_pieces(self) -> list[Piece]:
        out = []
        for a, _ in self.bounds:
            start, _, page, _ = self._group(a)
            out.append(Piece(page + (a - start) // self.param_len, (a - start) % self.param_len))
        return out

    def opt_pieces(self, family: int) -> list[Piece]:
        out = []
        for a, _ in self.bounds:
            start, g_size, _, page = self._group(a)
            at = family * g_size + a - start
            out.append(Piece(page + at // self.opt_len, at % self.opt_len))
        return out


def _leaf_groups(layout: StageLayout) -> list[tuple[int, list[int]]] | None:
    """Per page group of the stage (in page order): (index of its first page, the indices of the leaves in it, in
    slot order), or None unless each group's leaves lie end to end, in slot order, from its first page's start."""
    first = layout.pages[0].id
    out = []
    for group in page_groups(layout.pages):
        lo, hi = group[0].id, group[-1].id
        leaves = [i for i, s in enumerate(layout.slots) if lo <= s.page <= hi]
        at = 0
        for i in leaves:
            s = layout.slots[i]
            if (s.page - lo) * group[0].length + s.offset != at:
                return None
            at += s.size
        out.append((lo - first, leaves))
    return out


def _cut(pages: Pages, pieces: list[Piece], bounds: tuple) -> tuple:
    """The segments out of the pages (a slice of a page is the whole page when it covers it)."""
    out = []
    for piece, (a, b) in zip(pieces, bounds):
        page = pages[piece.page]
        whole = piece.offset == 0 and b - a == page.shape[0]
        out.append(page if whole else jax.lax.slice(page, (piece.offset,), (piece.offset + b - a,)))
    return tuple(out)


def _paste(segments: tuple, pieces: list[Piece], pages: int, length: int, dtype: Any) -> tuple:
    """Segments back into `pages` pages of `length` elements, padding zero (as `StageLayout.pack` leaves it)."""
    parts: list[list] = [[] for _ in range(pages)]
    for seg, piece in zip(segments, pieces):
        parts[piece.page].append(seg)
    out = []
    for part in parts:
        used = sum(p.shape[0] for p in part)
        if len(part) == 1 and used == length:
            out.append(part[0])
            continue
        # (the dtype a concatenation of the segments and a zero tail of `dtype` would have)
        page_dtype = jnp.result_type(*part, *([dtype] if used < length else []))
        out.append(written_page([p.astype(page_dtype) for p in part], length, page_dtype))
    return tuple(out)


def make_flat_update(plan: FlatPlan, tx: optax.GradientTransformation, grad_clip: float,
                     reduce: Callable[[jax.Array], jax.Array] | None = None) -> Callable:
    """`make_stage_update`'s update, computed on the plan's segments (same arguments, same results)."""
    p_pieces = plan.param_pieces()
    o_pieces = [plan.opt_pieces(f) for f in range(plan.families)]
    bounds = plan.bounds

    def view(param_pages: Pages, opt_pages: Pages, opt_small: list) -> tuple:
        """(parameter segments, optax state over segments)."""
        big = [seg for pieces in o_pieces for seg in _cut(opt_pages, pieces, bounds)]
        big_it, small_it = iter(big), iter(opt_small)
        state = jax.tree.unflatten(plan.state_treedef, [next(big_it) if p else next(small_it) for p in plan.paged])
        return _cut(param_pages, p_pieces, bounds), state

    def step(pages: tuple, norm: jax.Array, lr_scale: jax.Array) -> tuple:
        """tx.update on a view of the pages: (updates, new state)."""
        param_pages, grad_pages, opt_pages, opt_small = pages
        params, state = view(param_pages, opt_pages, opt_small)
        return tx.update(clip_with_norm(_cut(grad_pages, p_pieces, bounds), norm, grad_clip), state, params,
                         lr_scale=lr_scale)

    def update(param_pages: Pages, grad_pages: Pages, opt_pages: Pages, opt_small: list, norm: jax.Array,
               ok: jax.Array, lr_scale: jax.Array) -> tuple:
        """Pages in and out as bits (memory/layout.py); the arithmetic on their values."""
        param_pages, grad_pages, opt_pages = (tuple(to_values(p, dtype) for p in pages) for pages, dtype in (
            (param_pages, plan.param_dtype), (grad_pages, plan.param_dtype), (opt_pages, plan.opt_dtype)))
        out_params, out_opt, small, update_sq, applied = on_values(param_pages, grad_pages, opt_pages, opt_small,
                                                                   norm, ok, lr_scale)
        return tuple(map(to_bits, out_params)), tuple(map(to_bits, out_opt)), small, update_sq, applied

    def on_values(param_pages: Pages, grad_pages: Pages, opt_pages: Pages, opt_small: list, norm: jax.Array,
                  ok: jax.Array, lr_scale: jax.Array) -> tuple:
        # The same arithmetic, arranged for XLA's CPU backend. It emits one loop per array it writes, and an
        # intermediate that two of those loops use and that it will not recompute (one with a division or a
        # square root: the clipped gradient, the normalised update; even a slice of a page) it writes to memory
        # and reads back: left to itself it wrote the clipped gradient, both moments, the normalised update and
        # the update, 3.7x the bytes the update needs. Here each loop computes what it needs from the pages:
        # the update by a call of `tx.update` of its own, each state family (Adam's mu, nu) by one more, each
        # call on its own view of the pages (views XLA cannot tell apart: an optimization barrier; nothing is
        # copied). XLA drops what each call computes unused. The update alone is written and read back: for its
        # norm, which decides `applied`, and for the parameters. Left: 2.1x the bytes needed with pages of one
        # segment each, the least for loops that write one array each when the norm must be known before any
        # page is written. (An optimizer page pieced together from several segments is still written to a new
        # buffer and copied into its donated one: 3.2x with 64 MiB pages for the bench's block.)
        pages = (param_pages, grad_pages, opt_pages, opt_small)
        views = jax.lax.optimization_barrier((pages,) * (1 + plan.families))
        updates, upd_state = step(views[0], norm, lr_scale)
        updates = jax.lax.optimization_barrier(updates)
        per_family = [jax.tree.leaves(step(v, norm, lr_scale)[1]) for v in views[1:]]
        k, new_leaves, seen = len(bounds), [], 0  # paged leaves: family by family, k segments each
        for j, (paged, leaf) in enumerate(zip(plan.paged, jax.tree.leaves(upd_state))):
            new_leaves.append(per_family[seen // k][j] if paged else leaf)
            seen += paged
        new_state = jax.tree.unflatten(plan.state_treedef, new_leaves)
        _, state = view(param_pages, opt_pages, opt_small)  # the old state, kept where the update is dropped
        update_sq = sum((jnp.sum(jnp.square(u.astype(jnp.float32))) for u in jax.tree.leaves(updates)),
                        jnp.zeros((), jnp.float32))
        if reduce is not None:
            update_sq = reduce(update_sq)
        applied = ok & jnp.isfinite(update_sq)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(applied, n, o), new, old)  # noqa: E731
        leaves = jax.tree.leaves(keep(new_state, state))
        new_big = [leaf for leaf, p in zip(leaves, plan.paged) if p]
        small = [leaf for leaf, p in zip(leaves, plan.paged) if not p]
        # New parameters page by page, from the whole old page: XLA writes them in place (in the donated page);
        # pieced together from slices it would write a new page and copy it over. Padding stays zero (0 + 0).
        u_pages = _paste(tuple(updates), p_pieces, plan.param_pages, plan.param_len, param_pages[0].dtype)
        out_params = tuple(jnp.where(applied, optax.apply_updates(p, u), p) for p, u in zip(param_pages, u_pages))
        out_opt = _paste(tuple(new_big), [piece for pieces in o_pieces for piece in pieces], plan.opt_pages,
                         plan.opt_len, opt_pages[0].dtype if opt_pages else None)
        return out_params, out_opt, small, update_sq, applied

    return update
