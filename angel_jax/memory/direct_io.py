"""Page files moved with O_DIRECT: a page's bytes go between its buffer and the disk without the page cache.

Why: on a 2-core VM (2026-12-02, `angel-jax bench io`) the disk tier's buffered writes cost 0.97 CPU-s per GB, two
thirds of it the kernel's copy into the page cache (perf), and its memory-mapped reads 0.60; through this module
0.10 and 0.08 (`experiments/results/io_cpu.jsonl`). On 2 cores every CPU-second of the disk path is taken from the
step's compute. ZeRO-Infinity's NVMe path moves its bytes the same way.

The files are the disk tier's tensorstore chunk files, byte for byte what tensorstore's zarr3 `bytes` codec writes
(little-endian, no header): the tier has tensorstore write each array's metadata, so tensorstore reads the pages.

O_DIRECT needs the buffer's address, the file offset and the length aligned to the device's logical block; `ALIGN`
(4096) covers the common devices. A page's aligned head moves with O_DIRECT, its tail (under `ALIGN` bytes) through
the page cache (O_DIRECT cleared on the descriptor). A buffer that is not aligned moves through a reused aligned
bounce buffer of `BOUNCE` bytes per thread (one memcpy, on memory already faulted in). Writes go to a temporary
file renamed over the chunk file once complete (and fsync'ed with `sync`), so a failed write leaves no chunk.
"""

from __future__ import annotations

import fcntl
import os
import threading

import numpy as np

ALIGN = 4096
"""Alignment of O_DIRECT buffers, offsets and lengths (the logical block of common devices)."""
BOUNCE = 8 << 20
"""Bytes of each thread's aligned bounce buffer, for page buffers that are not aligned."""

_local = threading.local()


class WrongSize(OSError):
    """A page file whose size is not the page's (truncated or overwritten by something else)."""


def aligned_empty(length: int, dtype: np.dtype | type) -> np.ndarray:
    """An uninitialised 1-D array whose data starts on an `ALIGN` boundary (O_DIRECT moves it without a bounce)."""
    dtype = np.dtype(dtype)
    raw = np.empty(length * dtype.itemsize + ALIGN, np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    return raw[start: start + length * dtype.itemsize].view(dtype)


def is_aligned(buf: np.ndarray) -> bool:
    return buf.ctypes.data % ALIGN == 0


def supported(directory: str) -> bool:
    """Whether files in `directory` take O_DIRECT writes (tmpfs and some network file systems refuse them)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = os.path.join(directory, f".angel_jax_direct.{os.getpid()}.{threading.get_ident()}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | os.O_CLOEXEC, 0o600)
    except OSError:
        return False
    try:
        os.write(fd, aligned_empty(ALIGN, np.uint8))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        try:
            os.unlink(probe)
        except OSError:
            pass


def _bounce() -> memoryview:
    buf = getattr(_local, "bounce", None)
    if buf is None:
        buf = _local.bounce = memoryview(aligned_empty(BOUNCE, np.uint8))
    return buf


def _bytes_of(array: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def _buffered(fd: int) -> None:
    """Clear O_DIRECT on `fd`: the unaligned tail of a page moves through the page cache."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)


def _write_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _read_all(fd: int, view: memoryview, offset: int, path: str, size: int) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise WrongSize(f"{path} ended at {offset + done:,} B while being read ({size:,} B expected)")
        done += got


def write_file(path: str, data: np.ndarray, sync: bool = True) -> None:
    """Write `data`'s bytes as the file `path` (replacing it), the aligned head with O_DIRECT."""
    src = _bytes_of(data)
    n = len(src)
    head = n - n % ALIGN
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | os.O_CLOEXEC, 0o644)
    try:
        if head and is_aligned(data):
            _write_all(fd, src[:head], 0)
        elif head:
            bounce = _bounce()
            for off in range(0, head, BOUNCE):
                k = min(BOUNCE, head - off)  # a multiple of ALIGN: head and BOUNCE are
                bounce[:k] = src[off: off + k]
                _write_all(fd, bounce[:k], off)
        if n > head:
            _buffered(fd)
            _write_all(fd, src[head:], head)
        if sync:
            os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_file(path: str, into: np.ndarray) -> np.ndarray:
    """Read the file `path` into `into` (contiguous, writable, exactly the file's size), the aligned head with
    O_DIRECT; FileNotFoundError when it is missing, WrongSize when its size is not `into`'s."""
    if not (into.flags.c_contiguous and into.flags.writeable):
        raise ValueError("read buffer must be contiguous and writable")
    dst = _bytes_of(into)
    n = len(dst)
    head = n - n % ALIGN
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size != n:
            raise WrongSize(f"{path} holds {size:,} B, {n:,} B were written")
        if head and is_aligned(into):
            _read_all(fd, dst[:head], 0, path, n)
        elif head:
            bounce = _bounce()
            for off in range(0, head, BOUNCE):
                k = min(BOUNCE, head - off)
                _read_all(fd, bounce[:k], off, path, n)
                dst[off: off + k] = bounce[:k]
        if n > head:
            _buffered(fd)
            _read_all(fd, dst[head:], head, path, n)
    finally:
        os.close(fd)
    return into
