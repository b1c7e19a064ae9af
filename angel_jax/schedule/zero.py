"""ZeRO-3 stage functions: every rank holds 1/N of each page family and computes on its rows of the batch.

The pages are those of a `ShardedPageLayout` (angel_jax/memory/sharded_layout.py): a global page is N ranks'
pages end to end, a jax.Array sharded over the mesh's one axis, 'fsdp', so rank r's shard is its own page. Every
stage function runs under `shard_map` over that mesh, with JAX's collectives inside:

    forward    all-gather the stage's parameter pages (each rank's shard -> the whole page on every rank),
               unpack the whole leaves, run the stage on the rank's rows
    backward   the same gather, recompute + vjp on the rank's rows, then pack the whole gradients into pages and
               reduce-scatter them: rank r receives the sum over ranks of its shard, scaled by 1/N (the mean
               over the ranks' rows, the whole batch's gradient); the sum of squares of the shards is summed over
               the ranks (the global norm), the loss averaged over them
    update     elementwise on each rank's own shards (the optimizer never sees a whole leaf: the rank layout's
               leaves are flat chunks), the update's sum of squares summed over the ranks

The executor, the updater and the page store are the single-device ones: they move global pages (their shards
move rank by rank, each in its own device's memory) and call these functions; nothing in them knows about ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from angel_jax.memory.layout import to_bits
from angel_jax.memory.sharded_layout import ShardedStageLayout
from models.parallel import experts_over

AXIS = "fsdp"
"""The mesh axis the pages and the batch rows are sharded over."""

PAGES = P(AXIS)
ROWS = P(AXIS)
"""A batch (or activation) whose first axis is rows: each rank has its own rows."""
MICRO_ROWS = P(None, AXIS)
"""Stacked micro-batches [M, rows, ...]: each rank has its own rows of every micro-batch."""
SCALAR = P()


@dataclass(frozen=True)
class Zero:
    """The mesh the pages are sharded over (one axis, `AXIS`, of every device of the run)."""

    mesh: Mesh

    @staticmethod
    def over(devices: Any) -> "Zero":
        devices = np.asarray(devices).reshape(-1)
        return Zero(Mesh(devices, (AXIS,)))

    @property
    def ranks(self) -> int:
        return self.mesh.devices.size

    def local_device(self) -> jax.Device:
        """This process's first device of the mesh: what the engine asks for its platform and free memory (another
        process's device cannot be asked: its memory stats are refused as not addressable)."""
        me = jax.process_index()
        return next(d for d in self.mesh.devices.flat if d.process_index == me)

    def pages(self, memory_kind: str | None = None) -> NamedSharding:
        """Where global pages live: sharded over the ranks, in `memory_kind` of each rank's device."""
        return NamedSharding(self.mesh, PAGES, memory_kind=memory_kind)

    def replicated(self, memory_kind: str | None = None) -> NamedSharding:
        """Where scalars live (the global norm, the guard's verdict, step counts): on every rank."""
        return NamedSharding(self.mesh, SCALAR, memory_kind=memory_kind)

    def rows(self) -> NamedSharding:
        return NamedSharding(self.mesh, ROWS)

    def view(self, layout: ShardedStageLayout) -> "ZeroView":
        return ZeroView(layout)

    # -------------------------------------------------------------------------------------------- stage calls
    def stage_jit(self, fn: Callable, signature: str) -> Callable:
        """`fn` (a stage function written for whole pages, given a `ZeroView` as its layout) under shard_map and
        jit. `signature` names its inputs and outputs (see `_SIGNATURES`); the scalars it returns are reduced over
        the ranks here: sums of squares summed, losses averaged."""
        ins, outs, reduce = _SIGNATURES[signature]

        def body(*args: Any) -> Any:
            with experts_over(AXIS):  # an MoE layer holding E/N experts exchanges tokens over the ranks
                out = fn(*args)
            if not isinstance(out, tuple):
                return _REDUCE[reduce[0]](out) if reduce else out
            return tuple(_REDUCE[r](o) if r else o for o, r in zip(out, reduce + (None,) * len(out)))

        compiled = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=ins, out_specs=outs, check_vma=False))
        return compiled if not self.serial else _waited(compiled)

    @property
    def serial(self) -> bool:
        """Whether programs with collectives over this mesh must run one at a time (`serial`)."""
        return serial(self.pages())

    def update_spmd(self, update: Callable, norm_only: bool = False) -> Callable:
        """A stage update over a rank's own pages (`make_stage_update` with `reduce=psum`) under shard_map:
        (params, grads, opt pages, small leaves, norm, ok, lr_scale) -> (params, opt pages, small, update sq,
        applied); `norm_only`: the first pass, (params, grads, opt, small, norm, lr_scale) -> update sq."""
        if norm_only:
            return jax.shard_map(update, mesh=self.mesh, in_specs=(PAGES, PAGES, PAGES, SCALAR, SCALAR, SCALAR),
                                 out_specs=SCALAR, check_vma=False)
        return jax.shard_map(update, mesh=self.mesh,
                             in_specs=(PAGES, PAGES, PAGES, SCALAR, SCALAR, SCALAR, SCALAR),
                             out_specs=(PAGES, PAGES, SCALAR, SCALAR, SCALAR), check_vma=False)


def serial(sharding: jax.sharding.Sharding) -> bool:
    """Whether programs over arrays laid out as `sharding` whose collectives span several devices must run one at
    a time: on the CPU backend, whose in-process collectives wait for every device's part on one shared thread
    pool, and which may start two independent programs in different orders on different devices, so two such
    programs in flight can each hold the threads the other needs (measured: an abort after 40 s waiting at a
    rendezvous). An accelerator runs each device's programs in order on its own stream."""
    devices = sharding.device_set
    return len(devices) > 1 and next(iter(devices)).platform == "cpu"


def _waited(fn: Callable) -> Callable:
    """`fn`, returning once its results are computed (see `Zero.serial`)."""
    def call(*args: Any) -> Any:
        return jax.block_until_ready(fn(*args))

    return call


def psum(x: jax.Array) -> jax.Array:
    """Summed over the ranks (inside shard_map)."""
    return jax.lax.psum(x, AXIS)


_REDUCE = {"sum": psum, "mean": lambda x: jax.lax.pmean(x, AXIS)}

# signature -> (in_specs, out_specs, reductions of the outputs from the third on: sum of squares, loss); the head's
# last input is its micro-batch's share of the step's scored targets (stagefns.py), the same on every rank
_SIGNATURES: dict[str, tuple] = {
    "forward": ((PAGES, ROWS), ROWS, ()),
    "forward_micro": ((PAGES, MICRO_ROWS), MICRO_ROWS, ()),
    "backward": ((PAGES, ROWS, ROWS), (PAGES, ROWS, SCALAR), (None, None, "sum")),
    "backward_first": ((PAGES, ROWS, ROWS), (PAGES, None, SCALAR), (None, None, "sum")),
    "head_backward": ((PAGES, ROWS, ROWS, SCALAR), (PAGES, ROWS, SCALAR, SCALAR), (None, None, "sum", "mean")),
    "backward_micro": ((PAGES, MICRO_ROWS, MICRO_ROWS), (PAGES, MICRO_ROWS, SCALAR), (None, None, "sum")),
    "backward_micro_first": ((PAGES, MICRO_ROWS, MICRO_ROWS), (PAGES, None, SCALAR), (None, None, "sum")),
    "head_backward_micro": ((PAGES, MICRO_ROWS, MICRO_ROWS, SCALAR), (PAGES, MICRO_ROWS, SCALAR, SCALAR),
                            (None, None, "sum", "mean")),
    "head_loss": ((PAGES, ROWS, ROWS, SCALAR), SCALAR, ("mean",)),
}


class ZeroView:
    """A stage's layout as its stage functions see it on one rank, inside shard_map: `unpack` gathers the rank's
    page shards into whole pages and unpacks the whole leaves; `pack` packs whole gradients and reduce-scatters
    them, so the rank keeps its shard of their mean over the ranks. Stands in for the `StageLayout` the stage
    functions unpack and pack with.

    Expert parallelism: a stage whose expert weights sit on pages of their own, their experts dividing evenly over
    the ranks (`ShardedStageLayout.keeps_apart`), keeps those pages on their rank. Rank r computes with its own
    E/N experts: `unpack` gives them as [E/N, ...] leaves, ungathered, and the MoE layer, told the axis by
    `models.parallel.experts_over` (entered by `Zero.stage_jit`), sends each expert the tokens of every rank routed
    to it and brings its outputs back with two all-to-alls. The gradient of a rank's experts then already holds
    every rank's tokens: `pack` scales it by 1/N (the mean over the ranks' losses) and reduces nothing."""

    def __init__(self, layout: ShardedStageLayout):
        self.layout = layout
        self.pages = layout.rank.pages  # what a rank's call receives
        self.own = tuple(layout.local(p) for p in layout.rank.pages)

    def unpack(self, pages: tuple) -> Any:
        whole = tuple(p if own else jax.lax.all_gather(p, AXIS, tiled=True) for p, own in zip(pages, self.own))
        return self.layout.unpack(whole, local=True)

    def pack(self, tree: Any) -> tuple:
        """Whole gradients -> the rank's gradient pages, as bits: summed over the ranks as values, then stored."""
        scale = 1.0 / self.layout.ranks
        return tuple(to_bits((rows if own else jax.lax.psum_scatter(rows.reshape(-1), AXIS, scatter_dimension=0,
                                                                    tiled=True)) * jnp.asarray(scale, rows.dtype))
                     for rows, own in zip(self.layout.scatter_rows(tree, local=True), self.own))

    def values(self, pages: tuple) -> tuple:
        return self.layout.values(pages)

    def bits(self, pages: tuple) -> tuple:
        return self.layout.bits(pages)
