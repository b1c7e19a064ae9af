"""Keep freed page buffers from staying in the process (glibc's malloc).

glibc serves large allocations with mmap and returns them to the OS on free, but it raises that threshold
dynamically (up to 32 MiB) each time such a block is freed; from then on page-sized buffers (staging copies, disk
reads and writes, host updates) come from its arenas, and freed ones stay in the process. In a run whose pages
stream through the host, that made the resident set grow to several times the bytes actually alive. Fixing the
threshold turns off the adjustment.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

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
