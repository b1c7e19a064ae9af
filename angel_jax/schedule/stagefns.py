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
The optimizer update per kind is `angel_jax.optim.stage_update.make_stage_update`, jitted where it runs by the updater.

The head's functions take one more input, `count`: the micro-batch's share of the step's scored targets (the loss
is a mean over a batch's scored targets, angel_jax/data/marks.py; `models.common.scored_share`), so that the
executor's mean over micro-batches is the whole batch's mean however unevenly they hold scored targets. Under
ZeRO each rank's rows are one more piece: the head divides the share by the ranks.

Micro-batches (gradient accumulation): `forward_micro` and `backward_micro` run a stage on every micro-batch of
an access in one call, a `scan` over them (stacked on a leading axis): the pages are unpacked once, and the call's
temporaries are allocated once per access rather than once per micro-batch (per-call temporaries of a block's
size are fresh memory the kernel maps on every call, see angel_jax/memory/malloc.py: measured 2x the time of an
access of 8 micro-batches of 64 tokens on the CPU). The backward sums the micro-batches' gradients in float32,
in micro-batch order, and scales the sums by 1/micro-batches once, back to the pages' dtype, with their sum of
squares: the global norm is that of the step's gradients, not of each micro-batch's; the head's also gives the
float32 sum of the micro-batches' losses. The same operations in the same order as calling the one-micro-batch
functions in turn and summing their gradient pages (`accumulate`, `mean_grads`): equal to float rounding (XLA
may compile the scanned body's kernels differently; bit for bit on the 24-block bench model, to about 1e-5 relative
on tests/test_micro_batches.py's).
With several accumulation passes a pass's calls give the float32 sums of its micro-batches' gradient pages
(`backward_micro_sums`, unscaled), which are added across passes where the stage's sum lives: on the device, or
for a streamed stage on the host, where `HostSums` does the adds and the final mean on the host placement's
compute.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from angel_jax.memory.crossing import onto
from angel_jax.memory.shardwise import Shardwise
from angel_jax.memory.layout import PageLayout, StageLayout, to_bits, to_values
from angel_jax.memory.tiers import HOST_MEMORY_KINDS
from angel_jax.optim.fused import HostOptimizer
from angel_jax.optim.stage_update import OptLayout, make_stage_update, make_stage_update_norm, sqsum
from angel_jax.schedule.updater import in_host_memory
from angel_jax.schedule.zero import Zero, psum, serial
from models.stages import StagedModel

Pages = tuple


class StageFunctions:
    """Compiled per kind: forward, backward (the head's: loss and gradients); the pure update per kind."""

    def __init__(self, staged: StagedModel, params_layout: PageLayout, opt_layout: PageLayout,
                 opt_structure: dict[str, OptLayout], tx: optax.GradientTransformation, grad_clip: float,
                 zero: Zero | None = None, elementwise: bool = False, kernel: HostOptimizer | None = None):
        """`zero`: the layouts are `ShardedPageLayout`s over its mesh (ZeRO-3, schedule/zero.py): the stage
        functions gather and reduce-scatter the pages across the ranks, the updates run on each rank's shards.
        `elementwise`: `tx` is element-wise (`optim.is_elementwise`): its updates may run on flat pages.
        `kernel`: `tx` is this Adam/AdamW/Lion (`optim.fused.host_optimizer`): its host updates run as the host kernel."""
        self.staged = staged
        kinds = staged.kinds()
        rep: dict[str, StageLayout] = {k: params_layout.stage(staged.stages[idx[0]].name) for k, idx in kinds.items()}
        opt_rep = {k: opt_layout.stage(staged.stages[idx[0]].name) for k, idx in kinds.items()}
        self.opt_structure = {k: opt_structure[staged.stages[idx[0]].name] for k, idx in kinds.items()}
        """kind -> how the optax state of a stage of that kind splits into pages and small leaves."""
        if zero is not None:  # compute sees whole leaves (gathered); updates a rank's own chunks
            view = {k: zero.view(r) for k, r in rep.items()}
            update_rep, update_opt_rep = {k: r.rank for k, r in rep.items()}, {k: r.rank for k, r in opt_rep.items()}
            jit: Callable[[Callable, str], Callable] = zero.stage_jit
        else:
            view, update_rep, update_opt_rep = dict(rep), rep, opt_rep
            jit = lambda fn, _: jax.jit(fn)  # noqa: E731
        for kind, lender in borrowed_kinds(staged).items():  # its calls take its pages, then its lender's
            lent = params_layout.stage(staged.stages[lender].name)
            view[kind] = Borrowing(view[kind], zero.view(lent) if zero is not None else lent)
        self.forward: dict[str, Callable] = {}
        self.backward: dict[str, Callable] = {}
        self.update: dict[str, Callable] = {}
        """kind -> pure update (`make_stage_update`); jitted where it runs by `StageUpdates`."""
        self.update_norm: dict[str, Callable] = {}
        self.update_rank: dict[str, Callable] = {}
        """ZeRO-3 only: kind -> the update of one rank's own shards alone, its sum of squares the rank's part (what
        runs shard by shard on the CPU backend where the pages cannot be computed on in place, memory/shardwise.py)."""
        self.update_norm_rank: dict[str, Callable] = {}
        self.forward_micro: dict[str, Callable] = {}
        """kind -> (pages, xs[M, ...]) -> ys[M, ...]: the forward of every micro-batch, one call."""
        self.backward_micro: dict[str, Callable] = {}
        """kind -> (pages, xs[M, ...], dys[M, ...]) -> (mean gradient pages, dxs[M, ...] or None, their sum of
        squares); the head's: (pages, xs, targets[M, ...]) -> (..., the float32 sum of the losses)."""
        self.backward_micro_sums: dict[str, Callable] = {}
        """kind -> as `backward_micro`, but the float32 sums of the micro-batches' gradient pages, unscaled, and in
        place of their sum of squares a scalar that is ready when the call is done (a pass's share of a step's
        sums)."""
        self.head_loss: Callable
        """(head pages, head input, targets, count) -> the loss, no gradients: the last stage of an evaluation."""
        last_kind, first_kind = staged.stages[-1].kind, staged.stages[0].kind
        loss = _rank_share(staged.loss, zero.ranks if zero is not None else 1)
        for kind in kinds:
            apply, r = staged.apply[kind], view[kind]
            role = "head_" if kind == last_kind else ""
            first = "_first" if kind == first_kind and kind != last_kind else ""

            def fwd(pages: Pages, x: jax.Array, apply=apply, r=r) -> jax.Array:
                return apply(r.unpack(pages), x)

            self.forward[kind] = jit(fwd, "forward")
            self.forward_micro[kind] = jit(_forward_micro(apply, r), "forward_micro")
            self.backward_micro[kind] = jit(_backward_micro(apply, r, loss if kind == last_kind else None,
                                                            has_dx=kind != first_kind),
                                            f"{role}backward_micro{first}")
            self.backward_micro_sums[kind] = jit(_backward_micro(
                apply, r, loss if kind == last_kind else None, has_dx=kind != first_kind, sums=True),
                f"{role}backward_micro{first}")
            if kind == last_kind:
                self.backward[kind] = jit(_head_backward(loss, apply, r), "head_backward")
                self.head_loss = jit(
                    lambda pages, x, targets, count=None, apply=apply, r=r: loss(apply(r.unpack(pages), x), targets,
                                                                                 count),
                    "head_loss")
            elif kind == first_kind:
                def bwd_first(pages: Pages, x: jax.Array, dy: jax.Array, apply=apply, r=r) -> tuple:
                    _, vjp = jax.vjp(lambda p: apply(p, x), r.unpack(pages))  # token ids have no gradient
                    (dparams,) = vjp(dy)
                    dpages = r.pack(dparams)
                    return dpages, None, sqsum(r.values(dpages))

                self.backward[kind] = jit(bwd_first, "backward_first")
            else:
                def bwd(pages: Pages, x: jax.Array, dy: jax.Array, apply=apply, r=r) -> tuple:
                    _, vjp = jax.vjp(apply, r.unpack(pages), x)
                    dparams, dx = vjp(dy)
                    dpages = r.pack(dparams)
                    return dpages, dx, sqsum(r.values(dpages))

                self.backward[kind] = jit(bwd, "backward")
            args = (tx, update_rep[kind], update_opt_rep[kind], self.opt_structure[kind], grad_clip)
            if zero is None:
                self.update[kind] = make_stage_update(*args, elementwise=elementwise, kernel=kernel)
                self.update_norm[kind] = make_stage_update_norm(*args, elementwise=elementwise, kernel=kernel)
            else:
                self.update[kind] = zero.update_spmd(make_stage_update(*args, reduce=psum, elementwise=elementwise,
                                                                        kernel=kernel))
                self.update_norm[kind] = zero.update_spmd(
                    make_stage_update_norm(*args, reduce=psum, elementwise=elementwise, kernel=kernel), norm_only=True)
                self.update_rank[kind] = make_stage_update(*args, elementwise=elementwise, kernel=kernel)
                self.update_norm_rank[kind] = make_stage_update_norm(*args, elementwise=elementwise, kernel=kernel)

    @staticmethod
    def accumulate(acc: Pages | None, dpages: Pages, dtypes: tuple) -> Pages:
        """Float32 sums of gradient pages (bits of the pages' `dtypes`, or float32 sums of a pass): `dpages` as
        float32 for the first micro-batch (acc None), else `acc + dpages`, written over `acc` (donated)."""
        dtypes = tuple(jnp.dtype(d).name for d in dtypes)
        if acc is None:
            return _float32(dpages, dtypes)
        return _add(acc, dpages, dtypes)

    @staticmethod
    def mean_grads(acc: Pages, micro_batches: int, dtypes: tuple) -> tuple[Pages, jax.Array]:
        """(sums x 1/micro_batches as the bits of pages of `dtypes`, their sum of squares). Over pages sharded over
        several CPU devices the sum of squares is a collective: waited for (`zero.serial`). (The float32 sums are
        not donated: the result is bits, which cannot take the sums' buffers.)"""
        scale = jnp.float32(1 / micro_batches)
        dtypes = tuple(jnp.dtype(d).name for d in dtypes)
        out = _mean(acc, scale, dtypes)
        return jax.block_until_ready(out) if serial(acc[0].sharding) else out


class Borrowing:
    """The layout a borrowing stage's functions see (`StagedModel.borrows`): its own pages followed by its
    lender's. `unpack` gives the pair (own parameters, lender's) its apply takes; `pack` takes the pair of their
    gradients and gives the pages in the same order, so the backward's gradient pages are the stage's own and then
    its gradient of the lender's parameters (the executor splits them)."""

    def __init__(self, own: Any, lent: Any):
        self.own, self.lent = own, lent
        self.pages = tuple(own.pages) + tuple(lent.pages)
        self.split = len(own.pages)
        """The number of the stage's own pages: where the lender's begin."""

    def unpack(self, pages: Pages) -> tuple:
        return self.own.unpack(pages[:self.split]), self.lent.unpack(pages[self.split:])

    def pack(self, tree: tuple) -> Pages:
        return tuple(self.own.pack(tree[0])) + tuple(self.lent.pack(tree[1]))

    def values(self, pages: Pages) -> Pages:
        return tuple(self.own.values(pages[:self.split])) + tuple(self.lent.values(pages[self.split:]))

    def bits(self, pages: Pages) -> Pages:
        return tuple(self.own.bits(pages[:self.split])) + tuple(self.lent.bits(pages[self.split:]))


def borrowed_kinds(staged: StagedModel) -> dict[str, int]:
    """Stage kind -> the stage whose parameters that kind's stages borrow (`StagedModel.borrows`); a kind's
    stages share their functions, so they must borrow the same lender."""
    out: dict[str, int] = {}
    kinds = staged.kinds()
    for i, lender in staged.borrows.items():
        kind = staged.stages[i].kind
        if {staged.borrows.get(j) for j in kinds[kind]} != {lender}:
            raise ValueError(f"the stages of kind {kind!r} do not all borrow stage {lender}'s parameters")
        out[kind] = lender
    return out


class HostSums:
    """Float32 sums of a stage's gradient pages kept on the host (accumulation passes: each pass's gradients of a
    streamed stage come to the host and are added there), computed on `compute`, the host placement's sharding
    (`angel_jax.schedule.updater.Placement`): `accumulate` and `mean_grads` as `StageFunctions`' (the sums donated).
    Operands are moved to `compute` first (on an accelerator, the host tier's pinned pages to the CPU backend);
    results stay there. `split`: ZeRO-3 pages on an accelerator, summed shard by shard on the CPU backend and
    joined back into the host tier (memory/shardwise.py). One instance per placement (`HostSums.on`), so engines
    share the compiled functions."""

    def __init__(self, compute: jax.sharding.Sharding, split: Shardwise | None = None):
        self.compute, self.split = compute, split
        self._jitted: dict[tuple, Callable] = {}

    @staticmethod
    @functools.cache
    def on(compute: jax.sharding.Sharding, split: Shardwise | None = None) -> "HostSums":
        return HostSums(compute, split)

    def accumulate(self, acc: Pages | None, dpages: Pages, dtypes: tuple) -> Pages:
        """`dpages` (bits of pages of `dtypes`, or float32 sums) as float32 (acc None), else `acc + dpages`,
        written over `acc`."""
        dpages = onto(dpages, self.compute)
        dtypes = tuple(jnp.dtype(d).name for d in dtypes)
        if acc is None:
            if all(d.dtype == jnp.float32 for d in dpages):
                return dpages
            return self._call(("float32", dtypes), lambda d: _float32_pages(d, dtypes), (), (dpages,))
        return self._call(("add", dtypes), lambda a, d: _add_pages(a, d, dtypes), (0,), (acc, dpages))

    def mean_grads(self, acc: Pages, micro_batches: int, dtypes: tuple) -> tuple[Pages, jax.Array]:
        """(sums x 1/micro_batches as the bits of pages of `dtypes`, their sum of squares), on the host."""
        dtypes = tuple(jnp.dtype(d).name for d in dtypes)
        scale = np.float32(1 / micro_batches)
        fn = lambda a: _mean_pages(a, scale, dtypes)  # noqa: E731
        if self.split is not None:
            return self.split.call(self._rank_jit(("mean", micro_batches, dtypes), fn), (acc,), ("pages", "sum"))
        out = self._jit(("mean", micro_batches, dtypes), fn, (), (self.compute, scalar_sharding(self.compute)))(acc)
        return jax.block_until_ready(out) if serial(self.compute) else out

    def _call(self, key: tuple, fn: Callable, donate: tuple, args: tuple) -> Pages:
        if self.split is None:
            return self._jit(key, fn, donate)(*args)
        return self.split.call(self._rank_jit(key, lambda *a: (fn(*a),)), args, ("pages",))[0]

    def _rank_jit(self, key: tuple, fn: Callable) -> Callable:
        """`fn` on one rank's shards on the compute device; nothing donated (inputs aliased from pinned memory)."""
        return self._cached(("rank",) + key, lambda: jax.jit(fn, out_shardings=self.split.on_compute))

    def _jit(self, key: tuple, fn: Callable, donate: tuple, out: Any = None) -> Callable:
        def make() -> Callable:
            inner = in_host_memory(fn) if self.compute.memory_kind in HOST_MEMORY_KINDS else fn
            return jax.jit(inner, donate_argnums=donate, out_shardings=out or self.compute)

        return self._cached(key, make)

    def _cached(self, key: tuple, make: Callable[[], Callable]) -> Callable:
        jitted = self._jitted.get(key)
        if jitted is None:
            jitted = self._jitted[key] = make()
        return jitted


def scalar_sharding(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
    """Where a scalar computed from arrays laid out as `sharding` lives: the same place, replicated over a mesh."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(),
                                          memory_kind=sharding.memory_kind)
    return sharding



def page_values(pages: Pages, dtypes: tuple[str, ...]) -> Pages:
    """Gradient pages as values: bits (unsigned) of pages of `dtypes` bitcast back, float32 sums as they are."""
    return tuple(to_values(p, d) if jnp.issubdtype(p.dtype, jnp.unsignedinteger) else p for p, d in zip(pages, dtypes))


def _rank_share(loss: Callable, ranks: int) -> Callable:
    """The model's loss for a rank's rows of a micro-batch: the micro-batch's `count` (its share of the step's
    scored targets) shared again over the ranks, whose losses are averaged (schedule/zero.py)."""
    if ranks == 1:
        return loss
    return lambda out, targets, count=None: loss(out, targets, None if count is None else count / ranks)


def _head_backward(loss: Callable, apply: Callable, rep: StageLayout) -> Callable:
    def head(pages: Pages, x: jax.Array, targets: jax.Array, count: jax.Array | None = None) -> tuple:
        def f(p: Any, h: jax.Array) -> jax.Array:
            return loss(apply(p, h), targets, count)

        value, (dparams, dx) = jax.value_and_grad(f, argnums=(0, 1))(rep.unpack(pages), x)
        dpages = rep.pack(dparams)
        return dpages, dx, sqsum(rep.values(dpages)), value

    return head


def _float32_pages(dpages: Pages, dtypes: tuple[str, ...]) -> Pages:
    return tuple(d.astype(jnp.float32) for d in page_values(dpages, dtypes))


def _forward_micro(apply: Callable, r: StageLayout) -> Callable:
    def forward(pages: Pages, xs: jax.Array) -> jax.Array:
        params = r.unpack(pages)
        return jax.lax.map(lambda x: apply(params, x), xs)

    return forward


def _backward_micro(apply: Callable, r: StageLayout, loss: Callable | None, has_dx: bool,
                    sums: bool = False) -> Callable:
    """The scanned backward of a stage (`loss` given: the head, whose second input is the targets and third the
    micro-batches' count, see the module's doc). `sums`: return the float32 sums of each micro-batch's gradient pages
    (each packed in the pages' dtype, as one call of the stage's backward gives them, then added in float32: the
    per-micro-batch `accumulate`'s arithmetic), unscaled."""

    def grads(params: Any, x: jax.Array, y: jax.Array, count: jax.Array | None) -> tuple:
        """(the micro-batch's loss or 0, parameter gradients, input gradient or None)."""
        if loss is not None:
            value, (dparams, dx) = jax.value_and_grad(lambda p, h: loss(apply(p, h), y, count),
                                                      argnums=(0, 1))(params, x)
            return value.astype(jnp.float32), dparams, dx
        if has_dx:
            _, vjp = jax.vjp(apply, params, x)
            dparams, dx = vjp(y)
            return jnp.zeros((), jnp.float32), dparams, dx
        _, vjp = jax.vjp(lambda p: apply(p, x), params)  # token ids have no gradient
        (dparams,) = vjp(y)
        return jnp.zeros((), jnp.float32), dparams, None

    def backward(pages: Pages, xs: jax.Array, second: jax.Array, count: jax.Array | None = None) -> tuple:
        params = r.unpack(pages)

        def body(carry: tuple, micro: tuple) -> tuple:
            total, acc = carry
            value, dparams, dx = grads(params, *micro, count)
            if sums:  # page sums
                acc = tuple(a + d.astype(jnp.float32) for a, d in zip(acc, r.values(r.pack(dparams))))
            else:
                acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, dparams)
            return (total + value, acc), dx

        zeros = tuple(jnp.zeros(p.shape, jnp.float32) for p in pages) if sums else \
            jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        (total, acc), dxs = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), (xs, second))
        if sums:  # (acc[0][0]: a scalar of their own, ready when the call is done, which no later add consumes)
            return (acc, dxs, acc[0][0], total) if loss is not None else (acc, dxs, acc[0][0])
        scale = jnp.float32(1 / jax.tree.leaves(xs)[0].shape[0])  # (activations may be pytrees)
        dpages = r.pack(jax.tree.map(lambda a, p: (a * scale).astype(p.dtype), acc, params))
        out = (dpages, dxs, sqsum(r.values(dpages)))
        return out + (total,) if loss is not None else out

    return backward


def _add_pages(acc: Pages, dpages: Pages, dtypes: tuple[str, ...]) -> Pages:
    return tuple(a + d.astype(a.dtype) for a, d in zip(acc, page_values(dpages, dtypes)))


def _mean_pages(acc: Pages, scale: jax.Array, dtypes: tuple[str, ...]) -> tuple[Pages, jax.Array]:
    out = tuple((a * scale).astype(d) for a, d in zip(acc, dtypes))
    return tuple(to_bits(o) for o in out), sqsum(out)


_float32 = jax.jit(_float32_pages, static_argnums=1)
_add = jax.jit(_add_pages, static_argnums=2, donate_argnums=0)
_mean = jax.jit(_mean_pages, static_argnums=2)
