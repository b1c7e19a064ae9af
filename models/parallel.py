"""What a model's layers need to know when they run inside a function mapped over the devices of a mesh.

    with experts_over("fsdp"):        # entered by the code that traces the per-device function
        y = stage(params, x)           # an MoE layer given E/N of its experts exchanges tokens over "fsdp"

Today that is one thing: the mesh axis a mixture of experts' experts are split over (expert parallelism). The
engine that shards the experts (angel_jax/schedule/zero.py) enters it while it traces its stage functions; a layer
that finds fewer experts in its weights than it routes to knows each device holds an even share of them, in axis
order, and sends the tokens routed to the others there with `jax.lax.all_to_all` (models/moe.py). Outside the
context, or with every expert in its weights, a layer computes alone.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

_EXPERT_AXIS: contextvars.ContextVar[str | None] = contextvars.ContextVar("expert_axis", default=None)


@contextlib.contextmanager
def experts_over(axis: str) -> Iterator[None]:
    """While tracing inside it, MoE layers whose weights hold a share of their experts exchange tokens over the
    mesh axis `axis`."""
    token = _EXPERT_AXIS.set(axis)
    try:
        yield
    finally:
        _EXPERT_AXIS.reset(token)


def expert_axis() -> str | None:
    """The mesh axis experts are split over here, or None."""
    return _EXPERT_AXIS.get()
