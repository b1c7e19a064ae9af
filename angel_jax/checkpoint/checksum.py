"""CRC-32 of array bytes, computed in parallel chunks and combined into the standard whole-buffer value.

Why CRC-32 (zlib's, CRC-32/ISO-HDLC): it is in the standard library (no new dependency), it releases the GIL on
large buffers (so chunks run on several cores), and anyone can check a stored value with
`zlib.crc32(array.tobytes())`. Chunking would normally change the value; `crc32_combine` (the GF(2) algebra from
zlib's crc32_combine, which Python does not expose) joins the chunk CRCs so the stored value is the plain CRC-32
of the array's bytes, whatever the chunk size or thread count.
"""

from __future__ import annotations

import functools
import zlib
from concurrent.futures import Executor
from typing import Sequence

CHUNK_BYTES = 8 << 20  # large enough to amortise the thread hand-off, small enough to spread 64 MiB over cores
_POLY = 0xEDB88320  # reflected CRC-32 polynomial used by zlib


def _gf2_times(mat: Sequence[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: Sequence[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


@functools.lru_cache(maxsize=64)
def _shift_operator(nbytes: int) -> tuple[int, ...]:
    """The 32x32 GF(2) matrix that advances a CRC register over `nbytes` zero bytes (cached: chunk sizes repeat)."""
    op = [_POLY] + [1 << n for n in range(31)]  # one zero bit
    op = _gf2_square(op)  # two zero bits
    op = _gf2_square(op)  # four zero bits
    result: list[int] | None = None
    nbytes_left = nbytes
    op = _gf2_square(op)  # eight zero bits = one byte
    while nbytes_left:
        if nbytes_left & 1:
            result = op if result is None else [_gf2_times(op, result[n]) for n in range(32)]
        nbytes_left >>= 1
        if nbytes_left:
            op = _gf2_square(op)
    assert result is not None
    return tuple(result)


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A+B given crc1 = CRC(A), crc2 = CRC(B) and len2 = len(B) in bytes."""
    if len2 <= 0:
        return crc1
    return _gf2_times(_shift_operator(len2), crc1) ^ crc2


def chunk_spans(nbytes: int, chunk: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    """(start, stop) byte spans covering [0, nbytes); one empty span for an empty buffer."""
    if nbytes == 0:
        return [(0, 0)]
    return [(s, min(s + chunk, nbytes)) for s in range(0, nbytes, chunk)]


def crc32_many(buffers: Sequence[memoryview], pool: Executor | None = None, chunk: int = CHUNK_BYTES) -> list[int]:
    """CRC-32 of each byte buffer; all chunks of all buffers share the pool so one large array uses every worker."""
    jobs = [(i, s, e) for i, buf in enumerate(buffers) for s, e in chunk_spans(len(buf), chunk)]

    def one(job: tuple[int, int, int]) -> int:
        i, s, e = job
        return zlib.crc32(buffers[i][s:e])

    crcs = list(pool.map(one, jobs)) if pool is not None and len(jobs) > 1 else [one(j) for j in jobs]
    out = [0] * len(buffers)
    for (i, s, e), c in zip(jobs, crcs):
        out[i] = c if s == 0 else crc32_combine(out[i], c, e - s)
    return out
