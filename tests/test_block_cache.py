"""angel_jax/memory/block_cache.py and large_blocks.c: freed large blocks handed out again, within the cap, with
malloc's contract kept (calloc zeroes, realloc keeps the bytes, alignments hold, threads and forks are safe),
in real processes started with the library preloaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from angel_jax.memory import block_cache

pytestmark = pytest.mark.skipif(block_cache.library() is None, reason="no C compiler to build the library")

MIB = 1 << 20


def run_preloaded(code: str, cap: int | None = 64 * MIB, timeout: float = 120) -> dict:
    """Run `code` in a fresh Python with the library preloaded; it prints one JSON object, returned here."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", block_cache.CAP_ENV)}
    if cap is not None:
        env[block_cache.CAP_ENV] = str(cap)
    env = block_cache.with_block_cache(env)
    prelude = textwrap.dedent("""
        import ctypes, json
        libc = ctypes.CDLL(None)
        for name in ("malloc", "calloc", "realloc", "aligned_alloc"):
            getattr(libc, name).restype = ctypes.c_void_p
        libc.malloc.argtypes = [ctypes.c_size_t]
        libc.calloc.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
        libc.realloc.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.aligned_alloc.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        libc.malloc_usable_size.argtypes = [ctypes.c_void_p]
        libc.malloc_usable_size.restype = ctypes.c_size_t
        libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
        def stats():
            out = (ctypes.c_size_t * 3)()
            libc.angel_block_cache_stats(out)
            return {"reused": out[0], "mapped": out[1], "kept": out[2]}
    """)
    done = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_freed_block_is_handed_out_again_and_calloc_still_zeroes():
    got = run_preloaded("""
        n = 8 << 20
        before = stats()
        p = libc.malloc(n)
        ctypes.memset(p, 0xAB, n)
        libc.free(p)
        q = libc.malloc(n - 1000)               # the same rounded size: the same block
        same = q == p
        libc.free(q)
        r = libc.calloc(1, n)                   # the same block again, which calloc must clear
        after = stats()                         # (before the checks below make Python objects of n bytes)
        zero = ctypes.string_at(r, n) == bytes(n)
        print(json.dumps({"same": same, "zero": zero, "again": r == p,
                          **{k: after[k] - before[k] for k in ("mapped", "reused")}}))
    """)
    assert got["same"] and got["again"] and got["zero"]
    assert got["mapped"] == 1 and got["reused"] == 2


def test_realloc_keeps_the_bytes_across_glibc_and_cached_blocks():
    got = run_preloaded("""
        small = libc.malloc(1000)               # glibc's
        ctypes.memmove(small, b"x" * 1000, 1000)
        big = libc.realloc(small, 4 << 20)      # stays glibc's: its bytes kept
        ok1 = ctypes.string_at(big, 1000) == b"x" * 1000
        libc.free(big)
        p = libc.malloc(2 << 20)                # a cached block, grown and shrunk
        ctypes.memmove(p, b"y" * (2 << 20), 2 << 20)
        q = libc.realloc(p, 6 << 20)
        ok2 = ctypes.string_at(q, 2 << 20) == b"y" * (2 << 20) and libc.malloc_usable_size(q) >= 6 << 20
        r = libc.realloc(q, 1500)               # much smaller: a glibc block now, the first bytes kept
        ok3 = ctypes.string_at(r, 1500) == b"y" * 1500
        libc.free(r)
        print(json.dumps({"ok": [ok1, ok2, ok3], **stats()}))
    """)
    assert got["ok"] == [True, True, True]


def test_alignments_hold():
    got = run_preloaded("""
        bad = []
        for align in (16, 64, 4096, 1 << 16, 2 << 20):
            for n in (100, 3 << 20):
                out = ctypes.c_void_p()
                assert libc.posix_memalign(ctypes.byref(out), align, n) == 0
                if out.value % align:
                    bad.append((align, n))
                libc.free(out.value)
                p = libc.aligned_alloc(align, n)
                if p % align:
                    bad.append((align, n, "aligned_alloc"))
                libc.free(p)
        print(json.dumps({"bad": bad}))
    """)
    assert got["bad"] == []


def test_kept_bytes_stay_within_the_cap():
    got = run_preloaded("""
        sizes = [(k % 7 + 1) << 20 for k in range(200)]
        blocks = [libc.malloc(n) for n in sizes]
        for p in blocks:
            libc.free(p)
        kept_after_free = stats()["kept"]
        huge = libc.malloc(100 << 20)           # over the cap: unmapped when freed, not kept
        libc.free(huge)
        print(json.dumps({"kept_after_free": kept_after_free, **stats()}))
    """, cap=16 * MIB)
    assert 0 < got["kept_after_free"] <= 16 * MIB
    assert got["kept"] <= 16 * MIB


def test_threads_and_a_fork_with_blocks_in_flight():
    """Threads allocating, filling, checking and freeing large blocks at once (ctypes drops the GIL), then a
    child process started while blocks are live: every block holds its own bytes, and the child runs."""
    got = run_preloaded("""
        import subprocess, sys, threading
        errors = []
        def work(seed):
            for k in range(60):
                n = ((seed + k) % 5 + 1) << 20
                p = libc.malloc(n)
                ctypes.memset(p, seed, n)
                if ctypes.string_at(p, n) != bytes([seed]) * n:
                    errors.append(seed)
                libc.free(p)
        live = [libc.malloc(3 << 20) for _ in range(4)]
        threads = [threading.Thread(target=work, args=(s,)) for s in range(1, 5)]
        for t in threads: t.start()
        child = subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True)
        for t in threads: t.join()
        for p in live: libc.free(p)
        print(json.dumps({"errors": errors, "child": child.stdout.strip(), **stats()}))
    """)
    assert got["errors"] == [] and got["child"] == "42"
    assert got["reused"] > got["mapped"]


def test_xla_computes_the_same_with_the_cache():
    code = """
        import jax, jax.numpy as jnp
        x = jax.random.normal(jax.random.key(0), (1024, 1024))
        ys = [float(jnp.sum((x * k) @ x)) for k in range(1, 4)]   # 4 MiB results, freed and asked for again
        print(json.dumps({"ys": ys, **stats()}))
    """
    got = run_preloaded(code)
    import jax
    import jax.numpy as jnp

    x = jax.random.normal(jax.random.key(0), (1024, 1024))
    assert got["ys"] == [float(jnp.sum((x * k) @ x)) for k in range(1, 4)]
    assert got["reused"] > 0


def test_the_cap_from_the_environment():
    assert block_cache.cap_from({}) == block_cache.DEFAULT_CAP
    assert block_cache.cap_from({block_cache.CAP_ENV: "123"}) == 123
    with pytest.raises(ValueError, match=block_cache.CAP_ENV):
        block_cache.cap_from({block_cache.CAP_ENV: "1GiB"})
    off = block_cache.with_block_cache({block_cache.CAP_ENV: "0", "LD_PRELOAD": "/x.so"})
    assert off["LD_PRELOAD"] == "/x.so" and not block_cache.wanted({block_cache.CAP_ENV: "0"})
    assert block_cache.with_block_cache({"LD_PRELOAD": "/x.so"}) == {"LD_PRELOAD": "/x.so"}  # off by default
    on = block_cache.with_block_cache({"LD_PRELOAD": "/x.so", block_cache.CAP_ENV: "1024"})
    assert on["LD_PRELOAD"] == f"{block_cache.library()} /x.so"
    assert block_cache.with_block_cache(on) == on and not block_cache.wanted(on)
