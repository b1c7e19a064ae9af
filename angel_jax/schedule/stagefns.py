"""Stage functions over pages: one jitted forward, backward and update per stage *kind*.

A stage function takes the stage's parameter pages (a tuple of flat arrays) and unpacks them inside jit, so XLA
fuses the slicing into the stage. Every block has the same page structure relative to its first page, so the
unpacking of `block.0`'s layout serves every block and one compilation serves the whole depth.

Backward recomputes the stage from its saved input (`jax.vjp`), so only stage inputs are kept between the forward
and the backward pass. The head stage computes the loss and its gradients in one call. Gradients come out page
shaped (padding gets zero gradient), so they go to host pages without repacking; each backward also returns the
sum of squares of its gradient pages, from which the global norm for clipping is formed without another pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from angel_jax.memory.layout import PageLayout, StageLayout
from angel_jax.optim import clip_with_norm
from angel_jax.stages import StagedModel

Pages = tuple


def _sqsum(pages: Pages) -> jax.Array:
    return sum((jnp.sum(jnp.square(p.astype(jnp.float32))) for p in pages), jnp.zeros((), jnp.float32))


@dataclass(frozen=True)
class OptLayout:
    """How a stage's optimizer state maps onto pages: leaves as large as parameters go to pages (the `opt`
    layout); small leaves (step counts, scalars) stay as small host arrays beside them."""

    treedef: Any
    paged: tuple[bool, ...]
    """Per leaf of the optax state: True if it lives in the stage's opt pages."""


def split_opt_state(opt_state: Any) -> tuple[list, list, OptLayout]:
    leaves, treedef = jax.tree.flatten(opt_state)
    paged = tuple(bool(getattr(leaf, "ndim", 0)) for leaf in leaves)
    big = [leaf for leaf, p in zip(leaves, paged) if p]
    small = [leaf for leaf, p in zip(leaves, paged) if not p]
    return big, small, OptLayout(treedef, paged)


def join_opt_state(big: list, small: list, layout: OptLayout) -> Any:
    big_it, small_it = iter(big), iter(small)
    leaves = [next(big_it) if p else next(small_it) for p in layout.paged]
    return jax.tree.unflatten(layout.treedef, leaves)


class StageFunctions:
    """Compiled per kind: forward, backward, head loss+gradients, optimizer update; all over pages."""

    def __init__(self, staged: StagedModel, params_layout: PageLayout, opt_layout: PageLayout,
                 opt_structure: dict[str, OptLayout], tx: optax.GradientTransformation, grad_clip: float,
                 *, update_device: jax.Device | None = None):
        self.staged = staged
        kinds = staged.kinds()
        self._rep: dict[str, StageLayout] = {k: params_layout.stage(staged.stages[idx[0]].name)
                                             for k, idx in kinds.items()}
        self._opt_rep = {k: opt_layout.stage(staged.stages[idx[0]].name) for k, idx in kinds.items()}
        self._opt_structure = {k: opt_structure[staged.stages[idx[0]].name] for k, idx in kinds.items()}
        self.forward: dict[str, Callable] = {}
        self.backward: dict[str, Callable] = {}
        self.update: dict[str, Callable] = {}
        last_kind = staged.stages[-1].kind
        first_kind = staged.stages[0].kind
        for kind in kinds:
            apply, rep = staged.apply[kind], self._rep[kind]

            def fwd(pages: Pages, x: jax.Array, apply=apply, rep=rep) -> jax.Array:
                return apply(rep.unpack(pages), x)

            self.forward[kind] = jax.jit(fwd)
            if kind == last_kind:
                self.backward[kind] = jax.jit(self._head_backward(apply, rep))
            elif kind == first_kind:
                def bwd_first(pages: Pages, x: jax.Array, dy: jax.Array, fwd=fwd) -> tuple:
                    _, vjp = jax.vjp(lambda p: fwd(p, x), pages)
                    (dpages,) = vjp(dy)
                    return dpages, None, _sqsum(dpages)

                self.backward[kind] = jax.jit(bwd_first)
            else:
                def bwd(pages: Pages, x: jax.Array, dy: jax.Array, fwd=fwd) -> tuple:
                    _, vjp = jax.vjp(fwd, pages, x)
                    dpages, dx = vjp(dy)
                    return dpages, dx, _sqsum(dpages)

                self.backward[kind] = jax.jit(bwd)
            self.update[kind] = jax.jit(self._make_update(kind, tx, grad_clip), donate_argnums=(0, 1, 2))
        self.update_device = jax.sharding.SingleDeviceSharding(update_device or jax.devices("cpu")[0])
        """Where updates of host-resident stages run: the XLA CPU backend."""

    def _head_backward(self, apply: Callable, rep: StageLayout) -> Callable:
        loss_fn = self.staged.loss

        def head(pages: Pages, x: jax.Array, targets: jax.Array) -> tuple:
            def f(p: Pages, h: jax.Array) -> jax.Array:
                return loss_fn(apply(rep.unpack(p), h), targets)

            loss, (dpages, dx) = jax.value_and_grad(f, argnums=(0, 1))(pages, x)
            return dpages, dx, _sqsum(dpages), loss

        return head

    def _make_update(self, kind: str, tx: optax.GradientTransformation, grad_clip: float) -> Callable:
        rep, opt_rep, structure = self._rep[kind], self._opt_rep[kind], self._opt_structure[kind]

        def update(param_pages: Pages, grad_pages: Pages, opt_pages: Pages, opt_small: list,
                   global_norm: jax.Array) -> tuple:
            params = rep.unpack(param_pages)
            grads = clip_with_norm(rep.unpack(grad_pages), global_norm, grad_clip)
            opt_state = join_opt_state(list(opt_rep.unpack(opt_pages)), opt_small, structure)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            big, small, _ = split_opt_state(opt_state)
            return rep.pack(params), opt_rep.pack(big), small, _sqsum(tuple(jax.tree.leaves(updates)))

        return update
