"""Host kernels, compiled on first use and registered with XLA as FFI targets of the CPU backend.

    if (reason := load_host_optimizer()) is None:   # None: `HOST_OPTIMIZER` is registered and may be called
        ...

The source ships beside this file. It is compiled once per machine with the system's C++ compiler (`CXX`, else
g++ or c++) against the headers jaxlib ships (`jax.ffi.include_dir()`), for this processor (`-march=native`),
into the cache of angel_jax/native.py, keyed by the source, the flags, the compiler, jaxlib's version and the
processor. Where nothing can be built (no
compiler, say), the reason comes back and the callers keep XLA's update: slower on the host, the same results.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

from angel_jax import native

log = logging.getLogger(__name__)

HOST_OPTIMIZER = "angel_host_optimizer"
"""The FFI target name of kernels/host_optimizer_cpu.cc."""

SOURCE = Path(__file__).with_name("host_optimizer_cpu.cc")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-std=c++20", "-fPIC", "-shared",
         "-pthread")
"""No contraction into fused multiply-adds: XLA's CPU backend does not contract either, so the kernel's
float32 results equal the XLA update's. No errno from sqrt: lets the loop vectorise (the value is the same)."""


def build(source: Path = SOURCE) -> Path:
    """The compiled shared library of `source` (built now unless cached). Raises RuntimeError with the
    compiler's message when it cannot be built."""
    import jax
    import jaxlib

    return native.build(source, native.cxx_compiler(), (*FLAGS, "-isystem", jax.ffi.include_dir()),
                        key_parts=(jaxlib.__version__,))


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
