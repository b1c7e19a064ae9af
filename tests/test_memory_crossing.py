"""Pages crossing between host memory and the XLA CPU backend (angel_jax/memory/crossing.py).

On an accelerator the host tier's pinned pages are aliased onto the CPU backend (no copy) and results come back with
one memcpy; that path is measured on a GPU (experiments/results/gpu_h200.md). What the CPU backend can check: the
alias really shares the bytes, the CPU client never donates an aliased buffer in place (so a page keeps its bytes
until the store replaces it), and within one client `onto` is plain `jax.device_put`."""

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from angel_jax.memory.crossing import _to_cpu, onto

CPU = jax.devices("cpu")[0]
COMPUTE = SingleDeviceSharding(CPU)
PINNED = SingleDeviceSharding(CPU, memory_kind="pinned_host")


def test_within_one_client_onto_is_device_put():
    x = jax.device_put(np.arange(6, dtype=np.float32), COMPUTE)
    (y,) = onto((x,), PINNED)
    assert y.sharding == PINNED
    np.testing.assert_array_equal(np.asarray(y), np.arange(6))


def test_host_pages_are_aliased_not_copied():
    page = jax.device_put(np.arange(8, dtype=np.float32), PINNED)
    alias = _to_cpu(page, COMPUTE)
    assert alias.unsafe_buffer_pointer() == page.unsafe_buffer_pointer()
    np.testing.assert_array_equal(np.asarray(alias), np.arange(8))


def test_an_aliased_page_is_never_updated_in_place():
    page = jax.device_put(np.arange(8, dtype=np.float32), PINNED)
    alias = _to_cpu(page, COMPUTE)
    new = jax.jit(lambda a: a * 2, donate_argnums=0)(alias)  # the host update donates its parameter pages
    np.testing.assert_array_equal(np.asarray(new), 2 * np.arange(8))
    np.testing.assert_array_equal(np.asarray(page), np.arange(8))  # the tier's page kept its bytes

