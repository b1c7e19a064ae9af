"""Pinned host memory on a GPU: XLA's pool, its limit, and how it grows.

On a GPU the host tier's pages are `pinned_host` arrays, which XLA serves from one pool (a best-fit-with-coalescing
allocator over pinned regions it allocates from the driver). The pool never returns a region, and it grows by
regions that double: 2 MiB, then whatever the request needs rounded up to a power-of-two multiple, then twice the
last, ... each capped by what is left under its limit, `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB` (64 GiB when unset).
So a pool whose limit is far above what the engine needs can take all of it in its last step: a 9.7 B GPT on one
H200 held 64 GiB of pages when its first step's gradients needed a little more, and the pool asked for the next
region, 113 GiB (the limit, 90% of RAM) less 64 = 49 GiB in one piece (52,613,349,376 B), and the process was
killed for host memory. The limit is the only bound on the pool: the engine sets it, before the GPU client starts,
to what its plan puts in the host tier (`schedule.pinned_limit.configure_pinned_limit`), and holds its plans to it.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
from collections.abc import Iterable, Mapping

GIB = 1 << 30
LIMIT_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
XLA_DEFAULT_LIMIT = 64 * GIB
"""XLA's pinned host pool limit when LIMIT_ENV is unset."""
FIRST_REGION = 2 << 20
SLACK = 1.1
"""The limit set for a plan: its host tier's bytes times this..."""
OVERHEAD = 1 * GIB
"""...plus this (staging of batches, transfers XLA pins for itself)."""
LEAST_LIMIT_GIB = 4


def limit_bytes(environ: Mapping[str, str] = os.environ) -> int:
    """The pinned pool's limit in effect (the variable is whole GiB)."""
    value = environ.get(LIMIT_ENV, "").strip()
    try:
        return int(float(value) * GIB) if value else XLA_DEFAULT_LIMIT
    except ValueError:
        return XLA_DEFAULT_LIMIT


def limit_for(host_tier_bytes: int) -> int:
    """The limit, in whole GiB, that holds a plan whose host tier peaks at `host_tier_bytes`."""
    return max(LEAST_LIMIT_GIB, math.ceil((host_tier_bytes * SLACK + OVERHEAD) / GIB))


def pool_regions(limit: int, sizes: Iterable[int]) -> list[int]:
    """The regions the pool allocates, in order, while arrays of `sizes` bytes are allocated one after another and
    none is freed (XLA's growth rule, as described above); stops where the pool cannot grow."""
    regions: list[int] = []
    region, pool, live = FIRST_REGION, 0, 0
    for size in sizes:
        live += size
        if live <= pool:
            continue
        grown = False
        while size > region:
            region *= 2
            grown = True
        take = min(region, limit - pool)
        if take < size:
            break
        regions.append(take)
        pool += take
        if not grown:
            region *= 2
    return regions


def gpu_memory_bytes() -> int | None:
    """The first NVIDIA GPU's memory as jax will use it (XLA_PYTHON_CLIENT_MEM_FRACTION of it, 0.75 by default),
    read with nvidia-smi, without starting a GPU client; None where there is none (or jax is kept off it)."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and not any(p.strip() in ("cuda", "gpu") for p in platforms.split(",")):
        return None
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        mib = float(out.strip().splitlines()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    try:
        fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
    except ValueError:
        fraction = 0.75
    return int(mib * (1 << 20) * fraction)
