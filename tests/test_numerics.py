"""The precision tests that compare two programs compare at (conftest.py): `highest_matmul_precision` sets fp32
matmuls to full precision for every thread and for child processes, the programs traced under it say so, and it
restores what was there; a `compares_programs` test runs under it, its module fixtures included."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import comparing_env, highest_matmul_precision

# The session's own setting (None unless the environment asked for one), read before any test ran.
SESSION_PRECISION = jax.config.jax_default_matmul_precision
A = jnp.asarray(np.random.default_rng(0).standard_normal((8, 8)), jnp.float32)


def _matmul_text() -> str:
    """The lowered program of a jitted fp32 matmul, traced now (the trace cache is keyed by the precision)."""
    return jax.jit(lambda a, b: a @ b).lower(A, A).as_text()


def _on_a_worker_thread(fn):
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


@pytest.fixture
def default_precision():
    """The platform's default matmul precision for the test (a CPU session runs at 'highest', conftest.py); the
    session's setting back afterwards."""
    env = os.environ.pop("JAX_DEFAULT_MATMUL_PRECISION", None)
    jax.config.update("jax_default_matmul_precision", None)
    yield
    jax.config.update("jax_default_matmul_precision", SESSION_PRECISION)
    if env is not None:
        os.environ["JAX_DEFAULT_MATMUL_PRECISION"] = env


def test_highest_precision_is_set_for_every_thread_and_child_and_restored(default_precision):
    env_before = os.environ.get("JAX_DEFAULT_MATMUL_PRECISION")
    assert "HIGHEST" not in _matmul_text()  # the default: what a GPU runs as TF32
    with highest_matmul_precision():
        assert jax.config.jax_default_matmul_precision == "highest"
        assert "precision = [HIGHEST, HIGHEST]" in _matmul_text()
        # The paged engine's worker threads see it (jax.default_matmul_precision(...) would not reach them).
        assert _on_a_worker_thread(lambda: jax.config.jax_default_matmul_precision) == "highest"
        assert "HIGHEST" in _on_a_worker_thread(_matmul_text)
        assert os.environ["JAX_DEFAULT_MATMUL_PRECISION"] == "highest"
    assert jax.config.jax_default_matmul_precision is None
    assert "HIGHEST" not in _matmul_text()
    assert os.environ.get("JAX_DEFAULT_MATMUL_PRECISION") == env_before


def test_a_child_started_with_the_comparing_env_computes_at_highest_precision():
    env = comparing_env({k: v for k, v in os.environ.items() if k != "JAX_DEFAULT_MATMUL_PRECISION"})
    child = subprocess.run([sys.executable, "-c", "import jax; print(jax.config.jax_default_matmul_precision)"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split() == ["highest"]


@pytest.fixture(scope="module")
def precision_at_module_setup() -> str | None:
    return jax.config.jax_default_matmul_precision


@pytest.mark.compares_programs
def test_a_marked_test_and_its_module_fixtures_run_at_highest_precision(precision_at_module_setup):
    assert precision_at_module_setup == "highest"
    assert jax.config.jax_default_matmul_precision == "highest"
    assert os.environ["JAX_DEFAULT_MATMUL_PRECISION"] == "highest"
    assert "precision = [HIGHEST, HIGHEST]" in _matmul_text()


def test_after_a_marked_test_the_session_precision_is_back():
    # (runs after the marked test above: test order is file order)
    assert jax.config.jax_default_matmul_precision == SESSION_PRECISION
    assert ("HIGHEST" in _matmul_text()) == (SESSION_PRECISION == "highest")
