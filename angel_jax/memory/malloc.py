"""Keep freed page buffers from staying in the process (glibc's malloc), and map large buffers with huge pages.

glibc serves large allocations with mmap and returns them to the OS on free, but it raises that threshold
dynamically (up to 32 MiB) each time such a block is freed; from then on page-sized buffers (staging copies, disk
reads and writes, host updates) come from its arenas, and freed ones stay in the process. In a run whose pages
stream through the host, that made the resident set grow to several times the bytes actually alive. Fixing the
threshold turns off the adjustment.

The price is a page fault for every 4 KiB of every large buffer, each time one is allocated: XLA's CPU backend
allocates its output and temporary buffers afresh for every call, so a host stage update of a 50 M parameter
block took 196,715 faults per call. With glibc's `glibc.malloc.hugetlb=1` tunable, mapped blocks are advised to
use transparent huge pages (2 MiB): 1,003 faults, and the update ran in 0.205 s instead of 0.424 s on a 2-core
VM (experiments/bench/host_optimizer.py; experiments/results/host_optimizer_cpu.jsonl). glibc reads tunables
once, at process start, from the environment (`GLIBC_TUNABLES`), so the launcher starts its workers with it
(`tuned`: with it, the large-block cache of angel_jax/memory/block_cache.py), and `angel-jax train` and
`angel-jax worker` started by hand (or by srun) restart themselves with both (`restart_tuned`) before anything
is allocated. It needs transparent huge pages in `madvise` or
`always` mode (/sys/kernel/mm/transparent_hugepage) and glibc 2.35 or later; elsewhere it changes nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from typing import Callable, Mapping

from angel_jax.memory import block_cache

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3
"""mallopt's parameter number (malloc.h)."""
THRESHOLD = 1 << 20
"""Allocations of this many bytes and more are mapped, and unmapped when freed."""

_done = False


def return_large_frees_to_the_os(threshold: int = THRESHOLD) -> bool:
    """Set glibc's mmap threshold once per process; False where the C library is not glibc (nothing to do)."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = bool(mallopt(M_MMAP_THRESHOLD, threshold))
    if not ok:
        log.debug("mallopt(M_MMAP_THRESHOLD, %d) was refused", threshold)
    _done = ok
    return ok


HUGE_PAGES = "glibc.malloc.hugetlb=1"
"""The glibc tunable that makes malloc advise transparent huge pages for the blocks it maps."""


def with_huge_pages(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` for a child process whose malloc maps large buffers with huge pages: `HUGE_PAGES` added to
    GLIBC_TUNABLES (colon-separated), unless that already sets `glibc.malloc.hugetlb` (left as it is)."""
    env = dict(environ)
    if not has_huge_pages(env):
        env["GLIBC_TUNABLES"] = ":".join([*(t for t in env.get("GLIBC_TUNABLES", "").split(":") if t), HUGE_PAGES])
    return env


def has_huge_pages(environ: Mapping[str, str]) -> bool:
    """Whether GLIBC_TUNABLES in `environ` sets `glibc.malloc.hugetlb` (to any value: a user's choice stands)."""
    return any(t.split("=", 1)[0] == "glibc.malloc.hugetlb" for t in environ.get("GLIBC_TUNABLES", "").split(":"))


def tuned(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` for a process that trains: huge pages for mapped blocks (`with_huge_pages`) and large blocks
    kept for reuse (angel_jax/memory/block_cache.py)."""
    return block_cache.with_block_cache(with_huge_pages(environ))


def restart_tuned(args: list[str], execve: Callable[..., None] = os.execve) -> None:
    """Replace this process with `python ARGS` under `tuned` (same pid; ARGS as this process was started, e.g.
    `-m angel_jax.cli train ...` or a script and its arguments), unless its environment already has both: glibc
    reads its tunables and the loader its preloads only at process start. Call it before anything large is
    allocated; it returns only when there is nothing to do."""
    if has_huge_pages(os.environ) and not block_cache.wanted(os.environ):
        return
    execve(sys.executable, [sys.executable, *args], tuned(os.environ))
