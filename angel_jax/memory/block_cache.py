"""Large blocks kept for reuse instead of mapped afresh: a malloc front preloaded into the processes that train.

    env = with_block_cache(os.environ)     # LD_PRELOAD and the cap set for a child process (or left as they are)
    cache = active()                        # in the trained process: BlockCache(cap_bytes=...) or None
    cache.stats()                           # blocks handed out again, blocks mapped, bytes kept now

Why: a paged step allocates gigabytes of large buffers (XLA:CPU allocates every output and temporary afresh for
every call; disk reads land in new arrays; the CPU backend's transfers copy into new buffers). glibc maps each
block above its mmap threshold (32 MiB at most, 1 MiB here: angel_jax/memory/malloc.py) and unmaps it on free,
so every page of every such block costs a page fault and a zeroed page each time. Sampled with perf during an
8-block step of the scale benchmark's GPT on the 2-core VM, the kernel zeroing fresh pages (`clear_page_erms`)
took 48% of the process's CPU time, and system time was 1.6x user time.

`large_blocks.c` (beside this file) keeps freed blocks of 1 MiB and more by their rounded size and hands them
out again for requests of that size; a paged step asks for the same sizes every time (fixed-size pages, the
same programs), so nearly every block is reused. At most `ANGEL_JAX_BLOCK_CACHE` bytes are kept (the oldest
kept blocks are unmapped beyond it): that much resident memory more than the bytes alive, which the engine's
host-peak check allows for. It is off by default (`DEFAULT_CAP` 0): set `ANGEL_JAX_BLOCK_CACHE=1073741824` to
keep up to 1 GiB. Smaller
requests go to glibc's malloc untouched.

It is a library preloaded at process start (LD_PRELOAD), so it is set up where the processes that train start:
`angel-jax train` and `angel-jax worker` restart themselves with it (angel_jax/memory/malloc.py, with the huge
pages tunable), and the launcher starts its workers with it. It is built on first use with the system's C
compiler (angel_jax/native.py); where it cannot be, nothing changes but the speed.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from angel_jax import native

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("large_blocks.c")
FLAGS = ("-O2", "-std=gnu11", "-fPIC", "-shared", "-pthread", "-Wall")
CAP_ENV = "ANGEL_JAX_BLOCK_CACHE"
"""Bytes of freed large blocks kept for reuse; 0 turns the cache off."""
DEFAULT_CAP = 0
"""Off unless asked for: its gain on a whole paged step is not yet measured apart from the machine's noise."""


@functools.cache
def library() -> Path | None:
    """The built library, or None (the reason is logged once)."""
    try:
        return native.build(SOURCE, native.c_compiler(), FLAGS)
    except (RuntimeError, OSError) as e:
        log.warning("the large-block cache is unavailable (large buffers are mapped afresh each time): %s", e)
        return None


def cap_from(environ: Mapping[str, str]) -> int:
    """The cap `environ` asks for (DEFAULT_CAP when unset). A malformed value is an error naming the variable."""
    text = environ.get(CAP_ENV, "").strip()
    if not text:
        return DEFAULT_CAP
    try:
        cap = int(text)
    except ValueError:
        cap = -1
    if cap < 0:
        raise ValueError(f"{CAP_ENV}={text!r}: expected a number of bytes >= 0 (0 turns the cache off)")
    return cap


def _preloaded(environ: Mapping[str, str], path: Path) -> bool:
    return str(path) in environ.get("LD_PRELOAD", "").replace(":", " ").split()


def with_block_cache(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` for a child process that keeps large blocks: the library first in LD_PRELOAD and the cap set,
    unless the cap is 0 or the library cannot be built (then `environ` as it is)."""
    env = dict(environ)
    cap = cap_from(env)
    path = library() if cap else None
    if path is None or _preloaded(env, path):
        return env
    env["LD_PRELOAD"] = " ".join([str(path), *env.get("LD_PRELOAD", "").replace(":", " ").split()])
    env[CAP_ENV] = str(cap)
    return env


def wanted(environ: Mapping[str, str]) -> bool:
    """Whether a process started with `environ` should restart to get the cache: it asks for one and the library
    is not preloaded in it yet."""
    if not cap_from(environ):
        return False
    path = library()
    return path is not None and not _preloaded(environ, path)


@dataclass(frozen=True)
class Stats:
    reused: int
    """Large blocks handed out again instead of mapped."""
    mapped: int
    """Large blocks mapped afresh."""
    kept_bytes: int
    """Bytes of freed blocks kept now."""


@dataclass(frozen=True)
class BlockCache:
    """The cache preloaded into this process."""

    cap_bytes: int

    def stats(self) -> Stats:
        out = (ctypes.c_size_t * 3)()
        ctypes.CDLL(None).angel_block_cache_stats(out)
        return Stats(*map(int, out))

    def describe(self) -> str:
        from angel_jax.units import human_bytes

        s = self.stats()
        return (f"large-block cache: up to {human_bytes(self.cap_bytes)} kept, {s.reused:,} blocks reused, "
                f"{s.mapped:,} mapped")


def kept_at_most() -> int:
    """The bytes this process may keep beyond what is alive: the cap of its cache, 0 without one."""
    cache = active()
    return cache.cap_bytes if cache else 0


def active() -> BlockCache | None:
    """The cache of this process, where the library is preloaded into it."""
    try:
        ctypes.CDLL(None).angel_block_cache_stats
    except AttributeError:
        return None
    return BlockCache(cap_from(os.environ))
