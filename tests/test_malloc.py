"""angel_jax/memory/malloc.py: huge pages for large buffers in the processes that train (GLIBC_TUNABLES), and the
launcher starting its workers with them."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from angel_jax.memory.malloc import HUGE_PAGES, with_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")

_FAULTS = """
import ctypes, resource
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
n = 256 << 20  # mapped by malloc (numpy would advise huge pages itself: XLA's buffers are plain malloc's)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
p = libc.malloc(n)
ctypes.memset(p, 1, n)  # touched once
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_with_huge_pages_adds_the_tunable_and_keeps_the_rest():
    assert with_huge_pages({})["GLIBC_TUNABLES"] == HUGE_PAGES
    env = with_huge_pages({"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert env["PATH"] == "/bin"
    assert env["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{HUGE_PAGES}"
    # A setting of its own is left alone (someone turned huge pages off on purpose).
    assert with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=0"


def _glibc_at_least(major: int, minor: int) -> bool:
    lib, version = platform.libc_ver()
    if lib != "glibc" or not version:
        return False
    got = tuple(int(x) for x in version.split(".")[:2])
    return got >= (major, minor)


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text() or not _glibc_at_least(2, 35),
                    reason="needs transparent huge pages (madvise or always) and glibc >= 2.35")
def test_huge_pages_cut_the_page_faults_of_a_large_buffer():
    """What the tunable is for: a large malloc'd buffer (XLA's per-call outputs and temporaries are such) costs a
    fault per 4 KiB page without it, and a few hundred times fewer with it."""
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}

    def faults(environ: dict[str, str]) -> int:
        out = subprocess.run([sys.executable, "-c", _FAULTS], env=environ, capture_output=True, text=True,
                             check=True)
        return int(out.stdout.strip().splitlines()[-1])

    plain, huge = faults(env), faults(with_huge_pages(env))
    assert plain > 60_000  # 65,536 pages of 4 KiB
    assert huge < plain / 20, (plain, huge)


def test_the_launcher_starts_its_workers_with_huge_pages_and_the_block_cache(tmp_path, write_tiny_config,
                                                                              monkeypatch):
    from angel_jax.memory import block_cache
    from angel_jax.tol import coordinator as co
    from angel_jax.tol.launch import Launcher

    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.setenv(block_cache.CAP_ENV, str(1 << 30))
    launcher = Launcher(write_tiny_config(tmp_path), [], workers=2)
    env = launcher._env(co.Spawn(attempt=0, nodes=("n0", "n1"), resume=False), rank=1, port=1234)
    assert HUGE_PAGES in env["GLIBC_TUNABLES"].split(":")
    assert env["LD_PRELOAD"].split()[0] == str(block_cache.library())


def test_train_restarts_itself_tuned_once(monkeypatch):
    """`angel-jax train` / `worker` started without the tunable or the large-block cache exec themselves again with
    both (same arguments); started with both, or with the tunable set (whatever its value) and the cache turned
    off, nothing happens."""
    from angel_jax.memory import block_cache
    from angel_jax.memory.malloc import restart_tuned

    calls = []
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.setenv(block_cache.CAP_ENV, str(1 << 30))
    restart_tuned(["-m", "angel_jax.cli", "train", "c.yaml", "train.steps=3"], execve=lambda *a: calls.append(a))
    ((exe, argv, env),) = calls
    assert exe == sys.executable and argv == [sys.executable, "-m", "angel_jax.cli", "train", "c.yaml",
                                              "train.steps=3"]
    assert env["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{HUGE_PAGES}"
    assert env["LD_PRELOAD"] == str(block_cache.library())
    assert env[block_cache.CAP_ENV] == str(1 << 30)
    for key, value in env.items():  # the restarted process: nothing more to do
        monkeypatch.setenv(key, value)
    restart_tuned(["-m", "angel_jax.cli", "train", "c.yaml"], execve=lambda *a: calls.append(a))
    monkeypatch.delenv("LD_PRELOAD")
    monkeypatch.setenv(block_cache.CAP_ENV, "0")
    for value in (HUGE_PAGES, "glibc.malloc.hugetlb=0"):
        monkeypatch.setenv("GLIBC_TUNABLES", value)
        restart_tuned(["-m", "angel_jax.cli", "train", "c.yaml"], execve=lambda *a: calls.append(a))
    assert len(calls) == 1
