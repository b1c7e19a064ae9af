"""What a model's layers need to know when they run inside a function mapped over the devices of a mesh.

    with experts_over("fsdp"):        # entered by the code that traces the per-device function
        y = stage(params, x)           # an MoE layer given E/N of its experts exchanges tokens over "fsdp"

Today that is one thing: the mesh axis a mixture of experts' experts are split over (expert parallelism). The
engines that shard the experts enter it while they trace: the sharded paged engine's stage functions, already
mapped over the devices (angel_jax/schedule/zero.py), where a layer that finds fewer experts in its weights than it
routes to knows each device holds an even share of them, in axis order; and the in-memory engine's step, a
whole-program jit over a mesh (angel_jax/train/engines.py), where the layer maps its exchange over the mesh
itself. Either way the tokens routed to other devices' experts go there and back with `jax.lax.all_to_all`
(models/moe.py). Outside the context, or with every expert in its weights, a layer computes alone.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

_EXPERTS: contextvars.ContextVar[tuple[str, Any] | None] = contextvars.ContextVar("experts", default=None)


@contextlib.contextmanager
def experts_over(axis: str, mesh: Any = None) -> Iterator[None]:
    """While tracing inside it, MoE layers split their experts over the mesh axis `axis`. Without `mesh` the code
    traced is already mapped over the devices (inside `shard_map`) and a layer whose weights hold a share of its
    experts exchanges tokens over `axis`. With `mesh` (a `jax.sharding.Mesh`) the code traced is a whole-program
    jit over that mesh (XLA's partitioner lays it out) and a layer whose experts divide evenly over `axis` maps
    its exchange over the mesh itself, rows of the batch over every axis, its experts over `axis`."""
    token = _EXPERTS.set((axis, mesh))
    try:
        yield
    finally:
        _EXPERTS.reset(token)


def expert_axis() -> str | None:
    """The mesh axis experts are split over here, or None."""
    found = _EXPERTS.get()
    return found[0] if found else None


def expert_mesh() -> Any:
    """The mesh of a whole-program jit whose MoE layers split their experts (`experts_over(axis, mesh)`), or None."""
    found = _EXPERTS.get()
    return found[1] if found else None
