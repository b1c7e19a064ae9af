"""Shardwise: elementwise programs over pages sharded over a mesh, run one shard at a time on one compute device.

On an accelerator, ZeRO-3's host tier holds each global page as its ranks' shards, each in the pinned host memory
of its own GPU. XLA does not compute on pinned memory (it would fall back to slow host compute), and the CPU
backend, where host updates run, is another client with one device per process: a program over the whole mesh
cannot run there. The host updates and gradient sums are elementwise over a rank's own shards, so each
addressable shard crosses to the compute device alone (`memory/crossing.py`: aliased through DLPack, no copy),
the rank's program runs on it, and its results cross back into the shard's own pinned memory (one memcpy) and are
joined into global arrays again. What is not elementwise is a scalar: a rank's partial sum of squares is summed
over the ranks by one small program over the mesh (a collective on the accelerator); a value every rank computes
alike (a step count, the guard's verdict) is put back replicated.

One process per accelerator is the layout this is built for (each process's CPU backend is its own, and its
ranks' host updates share the host's cores: `optim.fused.kernel_threads`); a process driving several local
devices runs their shards one after another on its one compute device.

    split = Shardwise(tier=host_pages, scalars=host_scalars, compute=cpu_device)
    per_rank = split.split((params, grads, norm))          # one tuple per local rank, every leaf on `compute`
    outs = [fn(*args) for args in per_rank]
    new_params, sq = split.join(outs, ("pages", "sum"))    # global pages in `tier`, sq summed over the ranks

On the CPU backend the same path runs when asked (`memory.accelerator_path`): shards are copied to the compute
device and back instead of aliased, so a test exercises exactly these moves.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from angel_jax.memory.crossing import onto

JOINS = ("pages", "same", "sum")
"""How a per-rank output becomes a global value: 'pages' (the rank's shard of a global page), 'same' (equal on every
rank: replicated), 'sum' (a partial scalar, summed over the ranks)."""


@dataclass(frozen=True)
class Shardwise:
    """Splits global arrays laid out as `tier` (pages) or `scalars` (replicated) into this process's ranks' shards on
    `compute`, and joins per-rank results back."""

    tier: jax.sharding.NamedSharding
    """The pages' sharding: one axis over the mesh, each rank's shard in its device's (host) memory."""
    scalars: jax.sharding.NamedSharding
    """Where replicated scalars live (the same mesh)."""
    compute: jax.Device
    """The device the programs run on (the CPU backend's)."""

    @property
    def ranks(self) -> list[jax.Device]:
        """This process's devices of the mesh, in mesh order (the order `split` returns their shards in)."""
        return [d for d in self.tier.mesh.devices.flat if d.process_index == jax.process_index()]

    @property
    def on_compute(self) -> jax.sharding.SingleDeviceSharding:
        return jax.sharding.SingleDeviceSharding(self.compute)

    def split(self, tree: Any) -> list[Any]:
        """Per local rank, `tree` with every global array replaced by that rank's shard on `compute` (pages: the
        rank's shard; replicated arrays: its copy). Non-array leaves (numpy, Python scalars) go to `compute` whole."""
        leaves, treedef = jax.tree.flatten(tree)
        by_device = [self._shards(leaf) for leaf in leaves]
        out = []
        for device in self.ranks:
            out.append(treedef.unflatten([onto(s[device], self.on_compute) if s is not None
                                          else jax.device_put(leaf, self.on_compute)
                                          for s, leaf in zip(by_device, leaves)]))
        return out

    def join(self, per_rank: Sequence[tuple], how: tuple[str, ...]) -> tuple:
        """Per-rank results (one tuple per local rank, as `split` ordered them) -> global values: output k (an
        array or a tree of arrays) joined as `how[k]` (`JOINS`)."""
        return tuple(self._join_tree(h, [result[k] for result in per_rank]) for k, h in enumerate(how))

    def _join_tree(self, how: str, parts: list[Any]) -> Any:
        leaves = [jax.tree.leaves(p) for p in parts]
        return jax.tree.unflatten(jax.tree.structure(parts[0]),
                                  [self._join(how, [rank[k] for rank in leaves]) for k in range(len(leaves[0]))])

    def call(self, fn: Callable, args: tuple, how: tuple[str, ...]) -> tuple:
        """`fn` on every local rank's shards of `args` in turn (on `compute`), its results joined by `how`."""
        return self.join([fn(*rank_args) for rank_args in self.split(args)], how)

    # ------------------------------------------------------------------------------------------------ pieces
    @staticmethod
    def _shards(x: Any) -> dict[jax.Device, jax.Array] | None:
        if not isinstance(x, jax.Array):
            return None
        return {s.device: s.data for s in x.addressable_shards}

    def _join(self, how: str, parts: list[jax.Array]) -> jax.Array:
        if how not in JOINS:
            raise ValueError(f"unknown join {how!r}: one of {JOINS}")
        ranks = self.ranks
        if how == "pages":
            sharding = self.tier
            shape = (parts[0].shape[0] * self.tier.mesh.devices.size, *parts[0].shape[1:])
        elif how == "same":
            sharding, shape = self.scalars, parts[0].shape
        else:
            return self._sum(parts)
        on = [onto(p, jax.sharding.SingleDeviceSharding(d, memory_kind=sharding.memory_kind))
              for p, d in zip(parts, ranks)]
        return jax.make_array_from_single_device_arrays(shape, sharding, on)

    def _sum(self, parts: list[jax.Array]) -> jax.Array:
        """Partial scalars of the local ranks -> their sum over every rank of the mesh, replicated in `scalars`."""
        mesh = self.tier.mesh
        spread = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(self.tier.spec[0]))
        rows = [onto(jnp.reshape(p, (1,)), jax.sharding.SingleDeviceSharding(d)) for p, d in zip(parts, self.ranks)]
        per_rank = jax.make_array_from_single_device_arrays((mesh.devices.size,), spread, rows)
        total = _summed(jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))(per_rank)
        if mesh.devices.flat[0].platform == "cpu" and mesh.devices.size > 1:
            total.block_until_ready()  # a collective on the CPU backend runs alone (schedule/zero.py `serial`)
        return jax.device_put(total, self.scalars)


@functools.cache
def _summed(replicated: jax.sharding.NamedSharding) -> Callable:
    return jax.jit(lambda x: jnp.sum(x.astype(jnp.float32)), out_shardings=replicated)
