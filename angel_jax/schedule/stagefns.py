"""Stage functions over pages: one jitted forward and backward per stage *kind*, the head's loss alone (for
evaluation), and the pure optimizer update.

A stage function takes the stage's parameter pages (a tuple of flat arrays) and unpacks them inside jit, so XLA
fuses the slicing into the stage. Every block has the same page structure relative to its first page, so the
unpacking of `block.0`'s layout serves every block and one compilation serves the whole depth.

Backward recomputes the stage from its saved input (`jax.vjp`), so only stage inputs are kept between the forward
and the backward pass. The head stage computes the loss and its gradients in one call. Gradients are taken with
respect to the unpacked parameters and packed into pages by one concatenation inside the same jit (differentiating
through `unpack` instead would build each page from one zero-padded page per leaf: measured 39% slower on a
block), so they leave the call page shaped, padding zero, ready for the host; each backward also returns the sum of
squares of its gradient pages, from which the global norm for clipping is formed without another pass.
The optimizer update per kind is `angel_jax.optim.paged.make_stage_update`, jitted where it runs by the updater.

Micro-batches (gradient accumulation) call forward and backward once per micro-batch, compiled for its shape;
`accumulate` adds a micro-batch's gradient pages into float32 sums in place (the sums donated), and `mean_grads`
scales the sums by 1/micro-batches once, back to the pages' dtype, with their sum of squares: the global norm is
that of the step's gradients, not of each micro-batch's. With several accumulation passes a streamed stage's sums
live on the host between passes: `HostSums` does the same two things there, on the host placement's compute.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from angel_jax.memory.layout import PageLayout, StageLayout
from angel_jax.memory.tiers import HOST_MEMORY_KINDS
from angel_jax.optim.paged import OptLayout, make_stage_update, make_stage_update_norm, sqsum
from angel_jax.optim.updater import in_host_memory
from models.stages import StagedModel

Pages = tuple


class StageFunctions:
    """Compiled per kind: forward, backward (the head's: loss and gradients); the pure update per kind."""

    def __init__(self, staged: StagedModel, params_layout: PageLayout, opt_layout: PageLayout,
                 opt_structure: dict[str, OptLayout], tx: optax.GradientTransformation, grad_clip: float):
        self.staged = staged
        kinds = staged.kinds()
        rep: dict[str, StageLayout] = {k: params_layout.stage(staged.stages[idx[0]].name) for k, idx in kinds.items()}
        opt_rep = {k: opt_layout.stage(staged.stages[idx[0]].name) for k, idx in kinds.items()}
        self.opt_structure = {k: opt_structure[staged.stages[idx[0]].name] for k, idx in kinds.items()}
        """kind -> how the optax state of a stage of that kind splits into pages and small leaves."""
        self.forward: dict[str, Callable] = {}
        self.backward: dict[str, Callable] = {}
        self.update: dict[str, Callable] = {}
        """kind -> pure update (`make_stage_update`); jitted where it runs by `StageUpdates`."""
        self.update_norm: dict[str, Callable] = {}
        """kind -> pure first pass of a guarded update (`make_stage_update_norm`)."""
        self.head_loss: Callable
        """(head pages, head input, targets) -> the mean loss, no gradients: the last stage of an evaluation."""
        last_kind, first_kind = staged.stages[-1].kind, staged.stages[0].kind
        for kind in kinds:
            apply, r = staged.apply[kind], rep[kind]

            def fwd(pages: Pages, x: jax.Array, apply=apply, r=r) -> jax.Array:
                return apply(r.unpack(pages), x)

            self.forward[kind] = jax.jit(fwd)
            if kind == last_kind:
                self.backward[kind] = jax.jit(self._head_backward(apply, r))
                self.head_loss = jax.jit(
                    lambda pages, x, targets, apply=apply, r=r: staged.loss(apply(r.unpack(pages), x), targets))
            elif kind == first_kind:
                def bwd_first(pages: Pages, x: jax.Array, dy: jax.Array, apply=apply, r=r) -> tuple:
                    _, vjp = jax.vjp(lambda p: apply(p, x), r.unpack(pages))  # token ids have no gradient
                    (dparams,) = vjp(dy)
                    dpages = r.pack(dparams)
                    return dpages, None, sqsum(dpages)

                self.backward[kind] = jax.jit(bwd_first)
            else:
                def bwd(pages: Pages, x: jax.Array, dy: jax.Array, apply=apply, r=r) -> tuple:
                    _, vjp = jax.vjp(apply, r.unpack(pages), x)
                    dparams, dx = vjp(dy)
                    dpages = r.pack(dparams)
                    return dpages, dx, sqsum(dpages)

                self.backward[kind] = jax.jit(bwd)
            self.update[kind] = make_stage_update(tx, r, opt_rep[kind], self.opt_structure[kind], grad_clip)
            self.update_norm[kind] = make_stage_update_norm(tx, r, opt_rep[kind], self.opt_structure[kind], grad_clip)

    @staticmethod
    def accumulate(acc: Pages | None, dpages: Pages) -> Pages:
        """Float32 sums of gradient pages: `dpages` as float32 for the first micro-batch (acc None), else
        `acc + dpages`, written over `acc` (donated)."""
        if acc is None:
            return tuple(d if d.dtype == jnp.float32 else d.astype(jnp.float32) for d in dpages)
        return _add(acc, dpages)

    @staticmethod
    def mean_grads(acc: Pages, micro_batches: int, dtypes: tuple) -> tuple[Pages, jax.Array]:
        """(sums x 1/micro_batches in the pages' `dtypes`, their sum of squares); float32 sums are donated."""
        scale = jnp.float32(1 / micro_batches)
        dtypes = tuple(jnp.dtype(d).name for d in dtypes)
        if all(d == "float32" for d in dtypes):
            return _mean_in_place(acc, scale, dtypes)
        return _mean(acc, scale, dtypes)

    def _head_backward(self, apply: Callable, rep: StageLayout) -> Callable:
        loss_fn = self.staged.loss

        def head(pages: Pages, x: jax.Array, targets: jax.Array) -> tuple:
            def f(p: Any, h: jax.Array) -> jax.Array:
                return loss_fn(apply(p, h), targets)

            loss, (dparams, dx) = jax.value_and_grad(f, argnums=(0, 1))(rep.unpack(pages), x)
            dpages = rep.pack(dparams)
            return dpages, dx, sqsum(dpages), loss

        return head


class HostSums:
    """Float32 sums of a stage's gradient pages kept on the host (accumulation passes: each pass's gradients of a
    streamed stage come to the host and are added there), computed on `compute`, the host placement's sharding
    (`angel_jax.optim.updater.Placement`): `accumulate` and `mean_grads` as `StageFunctions`' (the sums donated).
    Operands are moved to `compute` first (on an accelerator, the host tier's pinned pages to the CPU backend);
    results stay there. One instance per sharding (`HostSums.on`), so engines share the compiled functions."""

    def __init__(self, compute: jax.sharding.Sharding):
        self.compute = compute
        self._jitted: dict[tuple, Callable] = {}

    @staticmethod
    @functools.cache
    def on(compute: jax.sharding.Sharding) -> "HostSums":
        return HostSums(compute)

    def accumulate(self, acc: Pages | None, dpages: Pages) -> Pages:
        """`dpages` as float32 (acc None), else `acc + dpages`, written over `acc`."""
        dpages = jax.device_put(dpages, self.compute)
        if acc is None:
            if all(d.dtype == jnp.float32 for d in dpages):
                return dpages
            return self._jit(("float32",), _float32_pages, ())(dpages)
        return self._jit(("add",), _add_pages, (0,))(acc, dpages)

    def mean_grads(self, acc: Pages, micro_batches: int, dtypes: tuple) -> tuple[Pages, jax.Array]:
        """(sums x 1/micro_batches in the pages' `dtypes`, their sum of squares), on the host."""
        dtypes = tuple(jnp.dtype(d).name for d in dtypes)
        scale = np.float32(1 / micro_batches)
        in_place = all(d == "float32" for d in dtypes)
        fn = self._jit(("mean", micro_batches, dtypes), lambda a: _mean_pages(a, scale, dtypes),
                       (0,) if in_place else ())
        return fn(acc)

    def _jit(self, key: tuple, fn: Callable, donate: tuple) -> Callable:
        jitted = self._jitted.get(key)
        if jitted is None:
            if self.compute.memory_kind in HOST_MEMORY_KINDS:
                fn = in_host_memory(fn)
            jitted = self._jitted[key] = jax.jit(fn, donate_argnums=donate, out_shardings=self.compute)
        return jitted


def _float32_pages(dpages: Pages) -> Pages:
    return tuple(d.astype(jnp.float32) for d in dpages)


def _add_pages(acc: Pages, dpages: Pages) -> Pages:
    return tuple(a + d.astype(a.dtype) for a, d in zip(acc, dpages))


def _mean_pages(acc: Pages, scale: jax.Array, dtypes: tuple[str, ...]) -> tuple[Pages, jax.Array]:
    out = tuple((a * scale).astype(d) for a, d in zip(acc, dtypes))
    return out, sqsum(out)


_add = jax.jit(_add_pages, donate_argnums=0)
_mean_in_place = jax.jit(_mean_pages, static_argnums=2, donate_argnums=0)
_mean = jax.jit(_mean_pages, static_argnums=2)  # other dtypes: the float32 sums cannot hold the result
