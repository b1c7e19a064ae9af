"""Where the in-memory engine's arrays live on the device mesh: ZeRO-3 / FSDP through `NamedSharding`.

    mesh = make_mesh(cfg.mesh, jax.devices())        # axes ('data', 'fsdp'), data x fsdp = the devices
    shardings = state_shardings(abstract_state, mesh)  # one NamedSharding per leaf of the training state

Why a per-leaf rule and nothing else: once every parameter and optimizer-state leaf carries a sharding over
'fsdp', XLA's SPMD partitioner inserts the all-gathers before a parameter is used and the reduce-scatters of
its gradient; the step's code is the replicated one. Each device then holds 1/fsdp of the state (plus the leaves
too small to split), each 'data' group of fsdp devices one whole copy of it.

Expert parallelism: a mixture of experts' stacked expert weights are split by whole experts instead
(`expert_spec`), and the engine traces its step inside `models.parallel.experts_over`, so each MoE layer sends
its tokens to the devices holding their experts with all-to-alls rather than gathering the experts.

The rule (`fsdp_spec`) shards a leaf's largest dimension that the fsdp size divides and replicates the rest
(scalars such as the step and Adam's count, and leaves no dimension of which divides). It depends on shapes
only, so the parameters and their optimizer moments, which have the same shapes, are laid out alike. With an
fsdp size of 1 (or a mesh without an 'fsdp' axis) every leaf is replicated: the data-parallel engine as it was.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from angel_jax.config import MeshConfig

FSDP = "fsdp"
"""The mesh axis the training state is sharded over; 'data' holds the replicas."""


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device]) -> Mesh:
    """The ('data', 'fsdp') mesh of `devices` (ConfigError when mesh.data x mesh.fsdp does not split them).
    Auto axes: XLA's partitioner places the computation from the shardings of its inputs and outputs."""
    shape = cfg.shape(len(devices))
    return jax.make_mesh(shape, ("data", FSDP), devices=devices, axis_types=(jax.sharding.AxisType.Auto,) * 2)


def fsdp_size(mesh: Mesh) -> int:
    return dict(mesh.shape).get(FSDP, 1)


def fsdp_spec(shape: Sequence[int], fsdp: int) -> P:
    """The PartitionSpec of a leaf of `shape`: its largest dimension divisible by `fsdp` over the 'fsdp' axis
    (the first of equal ones), or replicated (P()) when there is none or fsdp is 1."""
    if fsdp > 1:
        for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
            if shape[dim] >= fsdp and shape[dim] % fsdp == 0:
                return P(*(FSDP if d == dim else None for d in range(len(shape))))
    return P()


def state_shardings(tree: Any, mesh: Mesh, expert_leaf: Callable[[str], bool] | None = None) -> Any:
    """One NamedSharding per leaf of `tree` (arrays or ShapeDtypeStructs), by `fsdp_spec`; `expert_leaf` (a
    model's `StagedModel.expert_leaf`, given a leaf's path): stacked expert weights and their optimizer moments
    whose experts divide evenly over 'fsdp' are split by expert instead (`expert_spec`)."""
    fsdp = fsdp_size(mesh)

    def spec(path: Any, a: Any) -> NamedSharding:
        if expert_leaf and expert_leaf(jax.tree_util.keystr(path)) and expert_spec(a.shape, fsdp) is not None:
            return NamedSharding(mesh, expert_spec(a.shape, fsdp))
        return NamedSharding(mesh, fsdp_spec(a.shape, fsdp))

    return jax.tree_util.tree_map_with_path(spec, tree)


def expert_spec(shape: Sequence[int], fsdp: int) -> P | None:
    """Expert parallelism: a stacked expert weight [E, d_in, d_out] (with the model's blocks stacked in front:
    [L, E, d_in, d_out]) split by whole experts over 'fsdp' (E/fsdp on each device, which computes with them; the
    tokens come to them, models/moe.py), or None when fsdp is 1 or does not divide E."""
    axis = len(shape) - 3
    if fsdp > 1 and axis >= 0 and shape[axis] % fsdp == 0:
        return P(*(FSDP if d == axis else None for d in range(len(shape))))
    return None


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """The global batch's rows over every device of the mesh (all its axes on the batch dimension, in order):
    each fsdp shard of a replica computes its own rows, as a data-parallel rank does."""
    return NamedSharding(mesh, P(tuple(mesh.axis_names)))


def device_bytes(tree: Any) -> dict[jax.Device, int]:
    """Bytes of `tree`'s arrays on each device of this process, counted from their live shards."""
    out: dict[jax.Device, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in getattr(leaf, "addressable_shards", ()):
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out


def whole(a: Any) -> Any:
    """`a` in full where this process can read it: itself when fully addressable, a local copy when replicated,
    else gathered from every process (a collective: every process must call it, leaf by leaf in the same order;
    one leaf at a time, so no device ever holds more than one whole leaf extra)."""
    if not isinstance(a, jax.Array) or a.is_fully_addressable:
        return a
    if a.sharding.is_fully_replicated:
        return a.addressable_data(0)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(a, tiled=True))
