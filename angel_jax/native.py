"""Shared libraries built on first use from sources that ship with the package (the host optimizer kernel, the
large-block cache), cached per machine.

    path = build(source, compiler=cxx_compiler(), flags=(...), key_parts=(...))   # RuntimeError: why not

A library is compiled once per machine with the system's compiler into a cache keyed by the source, the flags,
the compiler's version, the processor and whatever else the caller names (`key_parts`: jaxlib's version for a
kernel built against its headers), under `ANGEL_JAX_KERNEL_CACHE`, else `$XDG_CACHE_HOME/angel_jax/kernels`, else
`~/.cache/angel_jax/kernels`. Processes that build at once each write their own file and rename it into place.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Sequence


def cache_dir() -> Path:
    if env := os.environ.get("ANGEL_JAX_KERNEL_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "angel_jax" / "kernels"


def _first_found(names: Sequence[str | None]) -> str | None:
    for name in names:
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def cxx_compiler() -> str | None:
    """The C++ compiler: `CXX`, else g++ or c++."""
    return _first_found((os.environ.get("CXX"), "g++", "c++"))


def c_compiler() -> str | None:
    """The C compiler: `CC`, else gcc or cc."""
    return _first_found((os.environ.get("CC"), "gcc", "cc"))


def processor() -> str:
    """What -march=native compiles for: the processor's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))][:2]
    return "\n".join(keep) or platform.machine()


def build(source: Path, compiler: str | None, flags: Sequence[str], key_parts: Sequence[str] = ()) -> Path:
    """The shared library compiled from `source` by `compiler` with `flags` (built now unless cached). Raises
    RuntimeError naming what failed: no compiler, or the compiler's message."""
    if compiler is None:
        raise RuntimeError(f"no compiler found to build {source.name} (set CC / CXX, or install gcc / g++)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = hashlib.sha256("\0".join([source.read_text(), " ".join(flags), *version, *key_parts,
                                    processor()]).encode()).hexdigest()[:16]
    out = cache_dir() / f"{source.stem}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [compiler, *flags, str(source), "-o", tmp]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        os.unlink(tmp)
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    os.replace(tmp, out)  # atomic: a process building beside this one never loads half a file
    return out
