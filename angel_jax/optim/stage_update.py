"""Optimizer updates on pages: any optax transformation applied to one stage at a time, in one jit.

The reference trainer applies `tx` to the whole parameter pytree. The paged engine applies the same `tx` to each
stage's parameters separately, where the stage's pages live (device or host), with the stage's slice of the
optimizer state. For element-wise optimizers (Adam(W), SGD, Lion, ...) that is the same arithmetic; global-norm
clipping, the one cross-stage coupling, is done with the norm over every stage's gradient pages, computed before
any update (`clip_with_norm`).

    big, small, layout = split_opt_state(tx.init(stage_params))      # page-sized leaves | scalars (step counts)
    update = make_stage_update(tx, params_rep, opt_rep, layout, grad_clip)
    pages, opt_pages, small, update_sq, applied = update(param_pages, grad_pages, opt_pages, small, norm, ok, lr_scale)

`update` unpacks the pages (slices XLA fuses), runs `tx.update` and `optax.apply_updates`, and packs the results
back into pages, all in one function meant to be jitted once per stage kind. Everything here is pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from angel_jax.memory.layout import StageLayout
from angel_jax.optim.factory import clip_with_norm
from angel_jax.optim.flat import FlatPlan, make_flat_update
from angel_jax.optim.fused import HostOptimizer, make_kernel_update

Pages = tuple


@dataclass(frozen=True)
class OptLayout:
    """How a stage's optimizer state maps onto pages: leaves with at least one axis go to the stage's optimizer
    pages (laid out by a `PageLayout` of their own); scalars (step counts) stay small arrays beside them."""

    treedef: Any
    paged: tuple[bool, ...]
    """Per leaf of the optax state (tree_flatten order): True if it lives in the stage's optimizer pages."""

    @property
    def num_small(self) -> int:
        return sum(1 for p in self.paged if not p)


def split_opt_state(opt_state: Any) -> tuple[list, list, OptLayout]:
    """optax state -> (paged leaves, small leaves, layout)."""
    leaves, treedef = jax.tree.flatten(opt_state)
    paged = tuple(bool(getattr(leaf, "ndim", 0)) for leaf in leaves)
    big = [leaf for leaf, p in zip(leaves, paged) if p]
    small = [leaf for leaf, p in zip(leaves, paged) if not p]
    return big, small, OptLayout(treedef, paged)


def join_opt_state(big: list, small: list, layout: OptLayout) -> Any:
    """Inverse of `split_opt_state`."""
    big_it, small_it = iter(big), iter(small)
    leaves = [next(big_it) if p else next(small_it) for p in layout.paged]
    return jax.tree.unflatten(layout.treedef, leaves)


def abstract_opt_state(tx: optax.GradientTransformation, stage_params: Any) -> tuple[list, list, OptLayout]:
    """`split_opt_state(tx.init(stage_params))` on shapes only (nothing allocated): for planning big models."""
    return split_opt_state(jax.eval_shape(tx.init, stage_params))


def paged_paths(tx: optax.GradientTransformation, stage_params: Any) -> list[str]:
    """For each leaf `abstract_opt_state` pages (in order), the path of the parameter it belongs to: the key path
    (`keystr`) of the leaf in the optax state, which ends with its parameter's (Adam's mu and nu, e.g.
    `[0].mu['moe']['w_in']`)."""
    paths_leaves, _ = jax.tree_util.tree_flatten_with_path(jax.eval_shape(tx.init, stage_params))
    return [jax.tree_util.keystr(path) for path, leaf in paths_leaves if getattr(leaf, "ndim", 0)]


def sqsum(pages: Pages) -> jax.Array:
    """Sum of squares of pages (float32): each stage's share of a global norm; padding contributes zero. The pages
    are values (`StageLayout.values`), never bits: a sum of the bits' squares would be a number, and wrong."""
    values_only(pages)
    return sum((jnp.sum(jnp.square(p.astype(jnp.float32))) for p in pages), jnp.zeros((), jnp.float32))


def values_only(pages: Pages) -> None:
    """Raise unless every page is typed as values (floats): arithmetic on pages held as bits (unsigned
    integers, memory/layout.py) would compute on the integers silently."""
    for p in pages:
        if jnp.issubdtype(p.dtype, jnp.unsignedinteger):
            raise TypeError(f"arithmetic on a page held as bits ({p.dtype}): view it as values first "
                            "(StageLayout.values)")


def global_norm(sqsums: list[jax.Array]) -> jax.Array:
    """The global L2 norm from per-stage sums of squares, summed in stage order (a fixed order: bitwise
    reproducible whatever the placement)."""
    total = sqsums[0]
    for s in sqsums[1:]:
        total = total + s
    return jnp.sqrt(total)


def make_stage_update(tx: optax.GradientTransformation, params_rep: StageLayout, opt_rep: StageLayout,
                      layout: OptLayout, grad_clip: float, reduce: Callable[[jax.Array], jax.Array] | None = None,
                      elementwise: bool = False, kernel: HostOptimizer | None = None) -> Callable:
    """The update of one stage over pages (pure; jit it):

        update(param_pages, grad_pages, opt_pages, opt_small, norm, ok, lr_scale)
            -> (param pages, optimizer pages, small leaves, sum of squares of the update, applied)

    `norm` is the global gradient norm (for clipping), `lr_scale` scales the step (`tx.update(..., lr_scale=)`:
    make_optimizer's transformations take it, `with_lr_scale`) and `ok` says whether the
    step's update may be applied at all (the anomaly guard's decision, train/step.py): where it is False, or
    where this stage's update is not finite, the old pages come back unchanged (the reference trainer's `keep`).
    The sum of squares is that of the computed update either way (what the update norm reports).
    `params_rep`/`opt_rep` may be any stage of the same kind: only page shapes and offsets relative to the
    stage's first page are used. `reduce`: how the update's sum of squares becomes the stage's (ZeRO-3: the pages
    are a rank's shard, the sum is taken over the ranks, schedule/zero.py), before it decides `applied`.
    `elementwise`: `tx` treats every element alike (not Adafactor, `factory.is_elementwise`): the update then runs
    on flat segments of the pages where the layouts allow it (flat.py: a few times fewer bytes moved on the CPU).
    `kernel`: `tx` is the Adam, AdamW or Lion it describes (`fused.host_optimizer`): on the CPU backend the update
    then runs as the host kernel (fused.py: one pass, every core), on any layout whose state mirrors the
    parameters (also a float32 master beside bfloat16 moments, which the flat update cannot run on)."""
    leafwise = _leafwise_update(tx, params_rep, opt_rep, layout, grad_clip, reduce)
    if elementwise and (plan := FlatPlan.build(tx, params_rep, opt_rep, layout.paged)) is not None:
        xla = make_flat_update(plan, tx, grad_clip, reduce)
    else:
        xla = leafwise
    fused = kernel and make_kernel_update(tx, params_rep, opt_rep, layout.paged, kernel, grad_clip, reduce, xla)
    return fused or xla


def _leafwise_update(tx: optax.GradientTransformation, params_rep: StageLayout, opt_rep: StageLayout,
                     layout: OptLayout, grad_clip: float, reduce: Callable[[jax.Array], jax.Array] | None) -> Callable:
    """`make_stage_update`'s update on the unpacked leaves: any optimizer, any layout."""

    def update(param_pages: Pages, grad_pages: Pages, opt_pages: Pages, opt_small: list, norm: jax.Array,
               ok: jax.Array, lr_scale: jax.Array) -> tuple:
        params = params_rep.unpack(param_pages)
        grads = clip_with_norm(params_rep.unpack(grad_pages), norm, grad_clip)
        opt_state = join_opt_state(list(opt_rep.unpack(opt_pages)), list(opt_small), layout)
        updates, new_state = tx.update(grads, opt_state, params, lr_scale=lr_scale)
        new_params = optax.apply_updates(params, updates)
        update_sq = sqsum(tuple(jax.tree.leaves(updates)))
        if reduce is not None:
            update_sq = reduce(update_sq)
        applied = ok & jnp.isfinite(update_sq)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(applied, n, o), new, old)  # noqa: E731
        big, small, _ = split_opt_state(keep(new_state, opt_state))
        return params_rep.pack(keep(new_params, params)), opt_rep.pack(big), small, update_sq, applied

    return update


def make_stage_update_norm(tx: optax.GradientTransformation, params_rep: StageLayout, opt_rep: StageLayout,
                           layout: OptLayout, grad_clip: float, reduce: Callable[[jax.Array], jax.Array] | None = None,
                           elementwise: bool = False, kernel: HostOptimizer | None = None) -> Callable:
    """Only the sum of squares of the stage's update, nothing written: the first pass when the step's update may
    be dropped for its global norm (`max_update_norm`), which is known only once every stage's update is."""
    full = make_stage_update(tx, params_rep, opt_rep, layout, grad_clip, reduce, elementwise, kernel)
    if hasattr(full, "norm_only"):  # the host kernel's own first pass
        return full.norm_only

    def update_sq(param_pages: Pages, grad_pages: Pages, opt_pages: Pages, opt_small: list, norm: jax.Array,
                  lr_scale: jax.Array) -> jax.Array:
        return full(param_pages, grad_pages, opt_pages, opt_small, norm, jnp.bool_(False), lr_scale)[3]

    return update_sq
