"""The stage update of Adam, AdamW and Lion by the host kernel (kernels/host_optimizer_cpu.cc): one pass over the
pages, every core, each byte read and written once.

    spec = host_optimizer(cfg.optimizer, schedule)                # None: not Adam/AdamW/Lion, or no kernel here
    update = make_kernel_update(plan, spec, grad_clip, reduce, fallback)   # make_stage_update's arguments/results

Why: XLA's CPU backend runs the flat update (flat.py) at 2.1x the bytes an AdamW update must move, and splits a
memory-bound loop into at most ceil(sqrt(cores)) parts (4 of 16 cores on the GPU machines' hosts). Host updates
bound paged training wherever stages stream (experiments/results/gpu_h200.md); the kernel moves 28 B per
float32 parameter (AdamW; Lion 20 B) and uses every core.

The kernel runs only on the CPU backend (`jax.lax.platform_dependent`): updates on an accelerator keep XLA's flat
update (`fallback`), where XLA is fast. Its arithmetic is optax's, operation for operation, in float32; the step
counts and coefficients (bias corrections, the learning rate at the step, the clipping trigger) are computed here
with optax's own expressions, so the results equal the XLA update's up to float32 rounding (measured: an element
now and then one unit in the last place apart, as XLA's own differently fused loops are; tests/test_host_kernel.py).

One difference, stated in the guard's terms: the kernel writes the new pages only where the step's verdict `ok`
(loss and gradient norm finite and within bounds) holds, known before the update, and cannot also withhold them
when the update itself comes out non-finite. For these optimizers that cannot happen with finite gradients and
state: Adam's |mu_hat| / sqrt(nu_hat) is bounded and its denominator is at least eps; Lion's step is a sign.
`applied` is `ok`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

from angel_jax.config import OptimizerConfig
from angel_jax.memory.layout import StageLayout
from angel_jax.multihost import processes_on_this_host
from angel_jax.optim.kernels import HOST_OPTIMIZER, load_host_optimizer

Pages = tuple


KERNEL_OPTIMIZERS = ("adamw", "adam", "lion")


@dataclass(frozen=True)
class HostOptimizer:
    """The arithmetic of `make_optimizer`'s Adam, AdamW or Lion (clipping aside): what the kernel needs to know."""

    lion: bool
    """Lion (one moment, a sign step) rather than Adam."""
    b1: float
    b2: float
    eps: float
    weight_decay: float
    """0 for Adam."""
    schedule: optax.Schedule
    master: bool = False
    """Bfloat16 parameters stepped through a float32 master (`optimizer.master_weights`)."""


def host_optimizer(cfg: OptimizerConfig, schedule: optax.Schedule) -> HostOptimizer | None:
    """The kernel's description of `make_optimizer(cfg)`, or None where the kernel does not apply (not Adam, AdamW
    or Lion, `host_kernel` off) or cannot be built here (the reason is logged once). The state may be float32 or
    bfloat16 (`stored_as`: the kernel widens the moments, updates in float32, rounds them to nearest even), and
    with master weights the parameters bfloat16 (`with_master_weights`: the step is the float32 master's)."""
    if _why_not_the_kernel(cfg) is not None:
        return None
    return HostOptimizer(cfg.name == "lion", cfg.b1, cfg.b2, cfg.eps,
                         0.0 if cfg.name == "adam" else cfg.weight_decay, schedule, cfg.master_weights)


def host_update_by(cfg: OptimizerConfig) -> str:
    """Who runs host updates under `cfg`, and why not the kernel where it does not: for the engine's report."""
    why = _why_not_the_kernel(cfg)
    return f"the fused host kernel ({cfg.name}), on every core" if why is None else f"XLA ({why})"


def _why_not_the_kernel(cfg: OptimizerConfig) -> str | None:
    """None where the kernel updates `cfg`'s optimizer here (building it if need be), else the reason."""
    if not cfg.host_kernel:
        return "optimizer.host_kernel is off"
    if cfg.name not in KERNEL_OPTIMIZERS:
        return f"the host kernel updates {', '.join(KERNEL_OPTIMIZERS)}; the optimizer is {cfg.name}"
    reason = load_host_optimizer()
    return None if reason is None else f"the host kernel could not be built: {reason.splitlines()[0]}"


def kernel_threads(env: Mapping[str, str] | None = None, cores: int | None = None) -> int:
    """Threads one process's kernel calls use: the cores this process may run on, shared with the other training
    processes on the same machine (`angel-jax launch -n N` starts N there; srun says how many tasks per node), so
    that N processes updating at once do not start N x cores threads."""
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    return max(1, cores // processes_on_this_host(env))


def kernel_table(tx: optax.GradientTransformation, params_rep: StageLayout, opt_rep: StageLayout,
                 opt_paged: tuple[bool, ...], spec: HostOptimizer) -> np.ndarray | None:
    """The kernel's `table` for a stage laid out as `params_rep`/`opt_rep`: per segment (a run of elements
    contiguous in every family: leaves that follow one another in all of them make one) its parameter page and
    offset (the gradients' are the same), the master's
    page and offset (-1, 0 without), mu's, nu's (Lion: -1, 0), and its length; page numbers count within the
    stage's pages of each layout. None where the state is not the optimizer's: its paged leaves must be whole
    mirrors of the parameters, family by family in the parameters' order (the master first, then Adam's mu and nu
    or Lion's mu), its small leaves the two step counts, the parameters float32 (bfloat16 with a master)."""
    p_slots = params_rep.slots
    param_dtype = jnp.bfloat16 if spec.master else jnp.float32
    if not p_slots or any(s.size == 0 or not s.shape or s.dtype != param_dtype for s in p_slots):
        return None
    abstract = jax.tree.unflatten(params_rep.treedef, [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in p_slots])
    with_paths = jax.tree_util.tree_flatten_with_path(jax.eval_shape(tx.init, abstract))[0]
    paged = tuple(bool(getattr(leaf, "ndim", 0)) for _, leaf in with_paths)
    if paged != tuple(opt_paged) or len(opt_rep.slots) != sum(paged):
        return None
    big = [(jax.tree_util.keystr(path), leaf) for (path, leaf), p in zip(with_paths, paged) if p]
    small = [leaf for (_, leaf), p in zip(with_paths, paged) if not p]
    n, families = len(p_slots), int(spec.master) + (1 if spec.lion else 2)
    if len(big) != families * n or len(small) != 2:
        return None
    for f in range(families):
        for i, slot in enumerate(p_slots):
            key, leaf = big[f * n + i]
            if tuple(leaf.shape) != slot.shape or not key.endswith(slot.path):
                return None
            if spec.master and f == 0 and (leaf.dtype != jnp.float32 or not key.startswith(".master")):
                return None
    p_index = {page.id: k for k, page in enumerate(params_rep.pages)}
    o_index = {page.id: k for k, page in enumerate(opt_rep.pages)}
    p_len = {page.id: page.length for page in params_rep.pages}
    o_len = {page.id: page.length for page in opt_rep.pages}
    rows = []
    for i, slot in enumerate(p_slots):
        mirrors = [opt_rep.slots[f * n + i] for f in range(families)]
        spans = [slot.spans(p_len[slot.page])] + [m.spans(o_len[m.page]) for m in mirrors]
        index = [p_index] + [o_index] * families
        at = [0] * len(spans)  # per family, its span in hand, and how far into it
        into = [0] * len(spans)
        left = slot.size
        while left:
            here = [sp[a] for sp, a in zip(spans, at)]
            length = min(stop - start - d for (_, start, stop), d in zip(here, into))
            places = [(ix[page], start + d) for ix, (page, start, _), d in zip(index, here, into)]
            master = places[1] if spec.master else (-1, 0)
            mu = places[1 + int(spec.master)]
            nu = (-1, 0) if spec.lion else places[2 + int(spec.master)]
            row = (*places[0], *master, *mu, *nu, length)
            if rows and _continues(rows[-1], row):
                rows[-1] = (*rows[-1][:8], rows[-1][8] + length)
            else:
                rows.append(row)
            left -= length
            for k, ((_, start, stop), d) in enumerate(zip(here, into)):
                into[k] = d + length
                if start + into[k] == stop:
                    at[k], into[k] = at[k] + 1, 0
    return np.asarray(rows, np.int64).reshape(-1)


def _continues(prev: tuple, row: tuple) -> bool:
    """Whether `row` starts where `prev` ends in every family (the same page, the next element): one segment."""
    n = prev[8]
    return all(row[k] == prev[k] and (row[k] < 0 or row[k + 1] == prev[k + 1] + n) for k in (0, 2, 4, 6))


def _coefficients(spec: HostOptimizer, grad_clip: float, small: list, norm: jax.Array, ok: jax.Array,
                  lr_scale: jax.Array, apply: bool) -> tuple[jax.Array, list]:
    """(the kernel's float32 coefficients, the new small leaves if the update is applied), with optax's
    expressions (scale_by_adam or scale_by_lion, tree_bias_correction, scale_by_schedule) for identical values."""
    count, sched_count = small
    count_inc = optax.safe_increment(count)
    bc1, bc2 = (1.0, 1.0) if spec.lion else (1 - spec.b1 ** count_inc, 1 - spec.b2 ** count_inc)
    step_size = -1 * spec.schedule(sched_count)
    trigger = norm < grad_clip if grad_clip > 0 else jnp.bool_(True)
    values = (1 - spec.b1, spec.b1, 1 - spec.b2, spec.b2, bc1, bc2, 0.0, spec.eps, spec.weight_decay, step_size,
              lr_scale, norm, max(grad_clip, 0.0), trigger, ok if apply else False)
    coeffs = jnp.stack([jnp.asarray(v).astype(jnp.float32) for v in values])
    return coeffs, [count_inc, optax.safe_increment(sched_count)]


def make_kernel_update(tx: optax.GradientTransformation, params_rep: StageLayout, opt_rep: StageLayout,
                       opt_paged: tuple[bool, ...], spec: HostOptimizer, grad_clip: float,
                       reduce: Callable[[jax.Array], jax.Array] | None, fallback: Callable) -> Callable | None:
    """`make_stage_update`'s update by the kernel on the CPU backend, `fallback` elsewhere; None where the stage's
    state is not the optimizer's (`kernel_table`). Two variants hang on it: `fresh_outputs` (below) and
    `norm_only`, the first pass of `make_stage_update_norm` (the update's sum of squares, nothing written)."""
    table = kernel_table(tx, params_rep, opt_rep, opt_paged, spec)
    if table is None:
        return None
    n_params, n_opt = len(params_rep.pages), len(opt_rep.pages)
    # In place: results alias the pages they replace, written in place when the caller donates them (else XLA
    # copies them first). Not in place (`fresh_outputs`): results in buffers of their own, for pages that cannot
    # be donated (an accelerator's pinned pages aliased onto the CPU backend, memory/crossing.py), which would
    # otherwise be copied before the kernel runs.
    aliases = {1 + i: 1 + i for i in range(n_params)} | {1 + 2 * n_params + j: 1 + n_params + j for j in range(n_opt)}
    threads = kernel_threads()

    def kernel(param_pages: Pages, grad_pages: Pages, opt_pages: Pages, opt_small: list, norm: jax.Array,
               ok: jax.Array, lr_scale: jax.Array, in_place: bool = True) -> tuple:
        coeffs, new_small = _coefficients(spec, grad_clip, list(opt_small), norm, ok, lr_scale, apply=True)
        shapes = [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in (*param_pages, *opt_pages)]
        call = jax.ffi.ffi_call(HOST_OPTIMIZER, (jax.ShapeDtypeStruct((), jnp.float32), *shapes),
                                input_output_aliases=aliases if in_place else None)
        sq, *pages = call(coeffs, *param_pages, *grad_pages, *opt_pages, table=table, param_pages=np.int64(n_params),
                          opt_pages=np.int64(n_opt), threads=np.int64(threads), lion=np.int64(spec.lion),
                          master=np.int64(spec.master))
        if reduce is not None:
            sq = reduce(sq)
        small = [jnp.where(ok, new, old) for new, old in zip(new_small, opt_small)]
        return tuple(pages[:n_params]), tuple(pages[n_params:]), small, sq, ok

    def update(*args: object) -> tuple:
        return jax.lax.platform_dependent(*args, cpu=kernel, default=fallback)

    def fresh_outputs(*args: object) -> tuple:
        return jax.lax.platform_dependent(*args, cpu=lambda *a: kernel(*a, in_place=False), default=fallback)

    def norm_kernel(param_pages: Pages, grad_pages: Pages, opt_pages: Pages, opt_small: list, norm: jax.Array,
                    lr_scale: jax.Array) -> jax.Array:
        coeffs, _ = _coefficients(spec, grad_clip, list(opt_small), norm, jnp.bool_(False), lr_scale, apply=False)
        call = jax.ffi.ffi_call(HOST_OPTIMIZER, jax.ShapeDtypeStruct((), jnp.float32))
        sq = call(coeffs, *param_pages, *grad_pages, *opt_pages, table=table, param_pages=np.int64(n_params),
                  opt_pages=np.int64(n_opt), threads=np.int64(threads), lion=np.int64(spec.lion),
                  master=np.int64(spec.master))
        return sq if reduce is None else reduce(sq)

    def norm_fallback(param_pages: Pages, grad_pages: Pages, opt_pages: Pages, opt_small: list, norm: jax.Array,
                      lr_scale: jax.Array) -> jax.Array:
        return fallback(param_pages, grad_pages, opt_pages, opt_small, norm, jnp.bool_(False), lr_scale)[3]

    def norm_only(*args: object) -> jax.Array:
        return jax.lax.platform_dependent(*args, cpu=norm_kernel, default=norm_fallback)

    update.fresh_outputs = fresh_outputs  # type: ignore[attr-defined]
    update.norm_only = norm_only  # type: ignore[attr-defined]
    return update
