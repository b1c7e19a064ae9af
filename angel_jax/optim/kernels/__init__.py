"""Host kernels, compiled on first use and registered with XLA as FFI targets of the CPU backend.

    if (reason := load_host_optimizer()) is None:   # None: `HOST_OPTIMIZER` is registered and may be called
        ...

The source ships beside this file. It is compiled once per machine with the system's C++ compiler (`CXX`, else
g++ or c++) against the headers jaxlib ships (`jax.ffi.include_dir()`), for this processor (`-march=native`),
into a cache keyed by the source, the flags, the compiler, jaxlib's version and the processor
(`ANGEL_JAX_KERNEL_CACHE`, else `$XDG_CACHE_HOME/angel_jax/kernels`, else `~/.cache/angel_jax/kernels`).
Processes that build at once each write their own file and rename it into place. Where nothing can be built (no
compiler, say), the reason comes back and the callers keep XLA's update: slower on the host, the same results.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

HOST_OPTIMIZER = "angel_host_optimizer"
"""The FFI target name of kernels/host_optimizer_cpu.cc."""

SOURCE = Path(__file__).with_name("host_optimizer_cpu.cc")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-std=c++20", "-fPIC", "-shared",
         "-pthread")
"""No contraction into fused multiply-adds: XLA's CPU backend does not contract either, so the kernel's
float32 results equal the XLA update's. No errno from sqrt: lets the loop vectorise (the value is the same)."""


def cache_dir() -> Path:
    if env := os.environ.get("ANGEL_JAX_KERNEL_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "angel_jax" / "kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _processor() -> str:
    """What -march=native compiles for: the processor's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))][:2]
    return "\n".join(keep) or platform.machine()


def build(source: Path = SOURCE) -> Path:
    """The compiled shared library of `source` (built now unless cached). Raises RuntimeError with the
    compiler's message when it cannot be built."""
    import jax
    import jaxlib

    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = hashlib.sha256("\0".join([source.read_text(), " ".join(FLAGS), *version, jaxlib.__version__,
                                    _processor()]).encode()).hexdigest()[:16]
    out = cache_dir() / f"{source.stem}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *FLAGS, "-isystem", jax.ffi.include_dir(), str(source), "-o", tmp]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        os.unlink(tmp)
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    os.replace(tmp, out)  # atomic: a process building beside this one never loads half a file
    return out


@functools.cache
def load_host_optimizer() -> str | None:
    """Build and register the host optimizer kernel once per process; None when it is registered, else why not."""
    import jax

    try:
        lib = ctypes.cdll.LoadLibrary(str(build()))
        jax.ffi.register_ffi_target(HOST_OPTIMIZER, jax.ffi.pycapsule(lib.AngelHostOptimizer), platform="cpu")
    except (RuntimeError, OSError, AttributeError) as e:
        log.warning("the host optimizer kernel is unavailable, host updates run XLA's: %s", e)
        return str(e)
    return None
