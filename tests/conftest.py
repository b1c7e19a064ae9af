"""Shared test set-up: CPU only, the matmul precision of tests that compare programs (`compares_programs`), and a
tiny learnable corpus + tiny model config for the training tests.

Kept small on purpose: every test file may rely on the CPU pin; the fixtures below cost nothing unless requested.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

# Tests run on the CPU (DESIGN.md "Conventions"); set before anything imports jax. An explicit JAX_PLATFORMS in the
# environment still wins, so a GPU run can be asked for on purpose.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# On the CPU, fp32 matmuls run at full precision whatever the matmul precision says, so a CPU session runs every
# test at 'highest' (children inherit it): the `compares_programs` mark then switches nothing. A switch retraces
# and recompiles every program the next test touches (test_paged.py ran 16% slower switching per test). A GPU
# session keeps the platform's default for unmarked tests, and the mark switches to 'highest' where it compares.
if os.environ["JAX_PLATFORMS"] == "cpu":
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
else:
    # On a GPU, XLA's reductions and scatters use atomics (their order varies from run to run) and its autotuner
    # picks kernels by timing: the same program run twice differs in the last bits (an H200 resumed run's eval loss
    # 5.0378025 against 5.0378034 uninterrupted). The suite's claims that a resume, or overlap against none, is
    # exact hold there with deterministic kernels, as a user who needs them sets it (docs/paged-training.md,
    # "Numerics").
    if "xla_gpu_deterministic_ops" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"),
                                                          "--xla_gpu_deterministic_ops=true"]))

# One persistent compilation cache for the session, inherited by every process a test starts: the suite compiles
# the same tiny programs in dozens of tests and subprocesses, and each is compiled once instead (a cache hit
# loads the very executable the compiler produced, so no result changes). Fresh per session, removed at exit.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache_dir = tempfile.mkdtemp(prefix="angel-jax-test-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")

# Python's bytecode, compiled once for the session: with PYTHONDONTWRITEBYTECODE set (as where the suite's time was
# measured) and a virtualenv installed without .pyc files (uv's default), every process compiled each module it
# imported from source, ~2.5 s of CPU per process that imports jax and angel_jax (a launcher, each of its workers,
# each CLI run, each multi-process check), and the suite starts many. The session writes the bytecode to a
# directory of its own (PYTHONPYCACHEPREFIX: nothing lands beside the sources), read by every process a test starts,
# removed at exit; a source edited meanwhile is compiled again (its size and time stamp are checked). A prefix set
# by the caller is kept, with the caller's choice about writing.
if "PYTHONPYCACHEPREFIX" not in os.environ:
    _pycache = tempfile.mkdtemp(prefix="angel-jax-test-pycache-")
    os.environ["PYTHONPYCACHEPREFIX"] = _pycache
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    atexit.register(shutil.rmtree, _pycache, ignore_errors=True)
    sys.pycache_prefix, sys.dont_write_bytecode = _pycache, False  # this process's later imports too

# The machine's disk calibration (`angel-jax bench io`, in ANGEL_JAX_CACHE_DIR) changes what plans predict and
# choose: the suite plans on the built-in figures wherever it runs, and a test that calibrates writes into this
# session's directory, never over the user's file. Every process a test starts inherits it.
if "ANGEL_JAX_CACHE_DIR" not in os.environ:
    _angel_cache = tempfile.mkdtemp(prefix="angel-jax-test-cache-")
    os.environ["ANGEL_JAX_CACHE_DIR"] = _angel_cache
    atexit.register(shutil.rmtree, _angel_cache, ignore_errors=True)

# Every program of the session, and of every process a test starts (they inherit the flag), compiled without
# XLA's backend (LLVM) optimisations: the suite's programs are tiny, so compiling dominates and running them
# slower costs less than it saves. What the tests compare is computed under the same settings on both sides.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    _flags = [os.environ.get("XLA_FLAGS"), "--xla_backend_optimization_level=0"]
    os.environ["XLA_FLAGS"] = " ".join(filter(None, _flags))

import pytest  # noqa: E402
import yaml  # noqa: E402
from hypothesis import settings  # noqa: E402

# Property tests: `make test` and CI draw the same examples every run (a suite that fails by chance is a broken
# suite; an example hypothesis once found goes in as an explicit @example). Run pytest without `make`, or with
# HYPOTHESIS_PROFILE=explore, to draw new random examples (and keep failures in the local .hypothesis database).
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "explore"))

# The precision tests that compare two programs compare at. On a GPU, fp32 matmuls default to TF32 (10 mantissa
# bits): two programs that compute the same thing differently (the whole model and its stages, sharded and on one
# device, our model and a reference formula) agree there to ~1e-3, not to fp32 rounding. A test that compares such
# programs is marked `compares_programs` and runs with fp32 matmuls at full precision, as the CPU computes them
# anyway; a test that compares a program with itself (a resume, bit for bit) needs no mark.
MATMUL_PRECISION = "highest"
_PRECISION_ENV = "JAX_DEFAULT_MATMUL_PRECISION"


def comparing_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`env` (this process's environment by default) for a child process whose results a test compares with
    another program's: the child's fp32 matmuls at full precision too."""
    return {**(os.environ if env is None else env), _PRECISION_ENV: MATMUL_PRECISION}


@contextlib.contextmanager
def highest_matmul_precision() -> Iterator[None]:
    """fp32 matmuls at full precision in this process and in every process started meanwhile; both restored
    after. The global setting, not `jax.default_matmul_precision(...)`: that context is thread-local, and the
    paged engine compiles and runs programs on worker threads."""
    import jax

    old_config, old_env = jax.config.jax_default_matmul_precision, os.environ.get(_PRECISION_ENV)
    jax.config.update("jax_default_matmul_precision", MATMUL_PRECISION)
    os.environ[_PRECISION_ENV] = MATMUL_PRECISION
    try:
        yield
    finally:
        jax.config.update("jax_default_matmul_precision", old_config)
        if old_env is None:
            os.environ.pop(_PRECISION_ENV, None)
        else:
            os.environ[_PRECISION_ENV] = old_env


def updates_agree_bitwise() -> bool:
    """Whether a stage updated on the device and one updated by the host's CPU backend compute the same bits: on
    the CPU both are the same processor's code; on a GPU the two processors round differently (fused multiply-adds,
    their own division and square root), so placements that differ in where stages update agree only closely."""
    import jax

    return jax.default_backend() == "cpu"


SERIAL_MODULES = {
    "test_watchdog_faults": "the watchdog's crash, hang and heartbeat timings, checked to the second",
    "test_tol_heartbeat": "the heartbeat server's idle and line deadlines, a few tenths of a second",
    "test_tol_launch": "heartbeats forged against the launcher's clock",
    "test_tol_worker": "a worker's exit and heartbeats timed against its server",
}
"""Test modules `make test` runs alone after the rest (scripts/run_tests.sh runs the rest in two workers): their
assertions hold wall-clock bounds that a second test suite on the same two cores could push over."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "compares_programs: compares the results of two different programs (engines, "
                                       "stage programs, a reference formula); runs with fp32 matmuls at full "
                                       "precision (conftest.highest_matmul_precision)")


SLOW_MODULES = ("test_watchdog_recovery", "test_zero", "test_slurm", "test_paged", "test_instruction_data",
                "test_fsdp", "test_zero_checkpoint", "test_paged_lockfree", "test_persist_floor", "test_paged_cli",
                "test_checkpoint_paged", "test_t5", "test_parked_activations", "test_preemption",
                "test_moe_documents", "test_paged_lockfree_disk", "test_step_phases")
"""The modules that take a quarter of a minute or more (launches, multi-process checks, shared reference runs),
slowest first. A pytest-xdist worker's collection puts them first, then the others by their number of tests, most
first (pytest-xdist's own order, which scripts/run_tests.sh turns off with --no-loadscope-reorder): the workers are
handed modules in that order, so the last to start are short ones and both workers end together (by number of tests
alone, test_slurm's three tests of ~100 s and test_paged_lockfree's one of ~40 s are among the last to start)."""


def _module_name(item: pytest.Item) -> str:
    module = getattr(item, "module", None)
    return module.__name__.rsplit(".", 1)[-1] if module is not None else ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _module_name(item) in SERIAL_MODULES:
            item.add_marker(pytest.mark.serial)
    if hasattr(config, "workerinput"):  # a pytest-xdist worker; a run in one process keeps the files' order
        first = {name: rank for rank, name in enumerate(SLOW_MODULES)}
        tests = collections.Counter(_module_name(item) for item in items)
        # Stable: a module's tests keep their order, and modules of as many tests keep the files' order.
        items.sort(key=lambda item: (first.get(_module_name(item), len(first)), -tests[_module_name(item)]))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    # Around the whole protocol, not in a fixture: the module- and session-scoped fixtures a marked test sets up
    # (shared reference runs) are computed at the precision the test compares at.
    if item.get_closest_marker("compares_programs") is None:
        return (yield)
    with highest_matmul_precision():
        return (yield)


REPO_ROOT = Path(__file__).resolve().parent.parent

# A short text repeated: a byte-level model learns it within a few dozen steps.
TOY_TEXT = "the quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs.\n"


def tiny_config_dict(corpus: tuple[Path, Path], run_dir: Path, **sections: dict) -> dict:
    """A tiny GPT (d_model 32, 2 layers, seq_len 32, batch 4, float32) on the toy corpus; `sections` update it.

    The schedule is constant after a 2-step warm-up so that the learning rate of step s does not depend on
    train.steps (a run extended from 6 to 30 steps follows the same schedule as one that ran 30 straight).
    """
    source, data_dir = corpus
    raw = {
        "name": "tiny",
        "model": {"vocab_size": 256, "seq_len": 32, "d_model": 32, "n_layers": 2, "n_heads": 2,
                  "compute_dtype": "float32"},
        "data": {"source": str(source), "tokenizer": "byte", "dir": str(data_dir)},
        "optimizer": {"name": "adamw", "lr": 3e-3, "warmup_steps": 2, "schedule": "constant"},
        "train": {"steps": 30, "batch_size": 4, "log_every": 1, "progress": False, "run_dir": str(run_dir)},
        # No loss.png: hundreds of short runs would each import matplotlib and draw (tests/test_pictures.py
        # draws them, with the key on).
        "logging": {"loss_curve": False},
        # The memory tier beside the run (not /dev/shm): test runs leave nothing in shared RAM.
        "checkpoint": {"every": 10, "keep": 2, "memory_dir": str(run_dir) + ".memtier"},
    }
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return raw


@pytest.fixture(scope="session")
def toy_corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(source text file, its prepared byte-level data dir): TOY_TEXT repeated, ~8.6k tokens.

    The trainer calls data.ensure_prepared(data.dir, data.source), which re-prepares a directory whose recorded
    source differs, so the directory is prepared from a real source file (a `write_tokens` directory would be
    replaced by the tokens of data.source).
    """
    from angel_jax.data import shards as data_lib

    root = tmp_path_factory.mktemp("toy-corpus")
    source = root / "toy.txt"
    source.write_text(TOY_TEXT * 100)
    data_dir = root / "toy-byte"
    data_lib.ensure_prepared(data_dir, str(source), tokenizer="byte")
    return source, data_dir


@pytest.fixture(scope="session")
def write_tiny_config(toy_corpus: tuple[Path, Path]):
    """Factory: write_tiny_config(directory, run="run", **sections) writes directory/<run>.yaml, a tiny config
    (see tiny_config_dict) whose run directory is directory/<run>, and returns the YAML's path."""

    def write(directory: Path, run: str = "run", **sections: dict) -> Path:
        path = Path(directory) / f"{run}.yaml"
        raw = tiny_config_dict(toy_corpus, Path(directory) / run, **sections)
        path.write_text(yaml.safe_dump(raw, sort_keys=False))
        return path

    return write


@pytest.fixture(scope="session")
def trained_tiny_run(tmp_path_factory: pytest.TempPathFactory, write_tiny_config):
    """Factory: trained_tiny_run(mode) -> (run directory, {step: the engine's parameters after it}) for a tiny run
    of 4 steps with memory.mode `mode` ('in_memory' or 'paged') and a checkpoint every 2 steps; the parameters are
    the engine's own (`TrainResult.params`). The in-memory run stops at step 2 and resumes to 4, so it has both
    steps' parameters; the paged one runs straight (step 4 only). Trained once per session and mode."""
    from angel_jax.config import load_config
    from angel_jax.train.loop import train

    memory = {"in_memory": {"mode": "in_memory"},
              "paged": {"mode": "paged", "page_size": 16384, "device_budget": 700_000}}
    runs: dict[str, tuple[Path, dict]] = {}

    def get(mode: str) -> tuple[Path, dict]:
        if mode not in runs:
            directory = tmp_path_factory.mktemp(f"trained-{mode}")
            config = write_tiny_config(directory, mode, memory=memory[mode], checkpoint={"every": 2, "keep": 2},
                                       logging={"loss_curve": True})  # test_pictures.py reads its loss.png
            at = {2: train(load_config(config, ["train.steps=2"])).params} if mode == "in_memory" else {}
            at[4] = train(load_config(config, ["train.steps=4"])).params
            runs[mode] = (directory / mode, at)
        return runs[mode]

    return get
