# Two commands set everything up on a fresh machine:
#   make train   create .venv (Python >= 3.12), install angel_jax, train the main job (experiments/gpt_tiny.yaml)
#   make test    the same set-up, then the test suite
# PYTHON=/path/to/python3.12 picks the interpreter; CONFIG=... and ARGS="key=value ..." change the job.
# ACCEL=auto|cpu|cuda picks jax's build (auto: CUDA 13 when nvidia-smi lists a GPU, or the interpreter's own
# CUDA-enabled jax when it has one); INSTALLER=auto|uv|pip the installer. scripts/setup_env.sh does the set-up
# (DRY_RUN=1 prints what it would do) and rebuilds the venv when ACCEL, the interpreter or the inputs change.
SHELL := /bin/bash
VENV ?= .venv
ACCEL ?= auto
INSTALLER ?= auto
CONFIG ?= experiments/gpt_tiny.yaml
ARGS ?=
PYTEST_ARGS ?=
TEST_WORKERS ?= 2
SETUP = VENV="$(VENV)" ACCEL="$(ACCEL)" INSTALLER="$(INSTALLER)" PYTHON="$(PYTHON)" scripts/setup_env.sh

# The test files that put arrays on devices (memory kinds, tiers, layouts, the step, the engines, paged and
# sharded): what `make test-gpu` runs on a CUDA device.
GPU_TESTS := tests/test_memory_layout.py tests/test_memory_tiers.py tests/test_memory_crossing.py \
	tests/test_memory_store.py tests/test_step_phases.py tests/test_micro_batches.py tests/test_train_eval.py \
	tests/test_paged.py tests/test_paged_state.py tests/test_paged_guard.py tests/test_paged_lockfree.py \
	tests/test_paged_runtime.py tests/test_fsdp.py tests/test_zero.py tests/test_page_bits.py tests/test_numerics.py \
	tests/test_streamed_device_updates.py tests/test_parked_activations.py

.PHONY: setup venv train test test-gpu test-lowest bench clean
.DEFAULT_GOAL := venv

# Creates or refreshes $(VENV); silent when it is up to date.
setup:
	@$(SETUP)

venv:
	@$(SETUP) --report

train: setup
	$(VENV)/bin/angel-jax train $(CONFIG) $(ARGS)

# Property tests draw the same examples every run (HYPOTHESIS_PROFILE=explore draws new ones); the slowest tests
# are listed at the end so that a slow-down shows. scripts/run_tests.sh runs the suite in TEST_WORKERS pytest-xdist
# workers, then the tests that check wall-clock bounds alone.
test: setup
	HYPOTHESIS_PROFILE=$${HYPOTHESIS_PROFILE:-ci} PY=$(VENV)/bin/python TEST_WORKERS=$(TEST_WORKERS) \
		scripts/run_tests.sh $(PYTEST_ARGS)

# The device-touching tests on a CUDA device (JAX_PLATFORMS=cuda,cpu: the host updates compute on the CPU
# backend), memory allocated as needed (child processes share the GPU); refused in one line when jax sees none.
test-gpu: setup
	@msg=$$($(VENV)/bin/python scripts/env_probe.py cuda-devices 2>/dev/null); rc=$$?; echo "make test-gpu: $$msg"; exit $$rc
	JAX_PLATFORMS=cuda,cpu XLA_PYTHON_CLIENT_PREALLOCATE=$${XLA_PYTHON_CLIENT_PREALLOCATE:-false} HYPOTHESIS_PROFILE=$${HYPOTHESIS_PROFILE:-ci} $(VENV)/bin/python -m pytest -q --durations=15 $(GPU_TESTS) $(PYTEST_ARGS)

# The checkpoint and resume tests against the lowest dependency versions pyproject.toml allows, in .venv-lowest
# (CI runs it after `make test`).
test-lowest:
	PYTHON="$(PYTHON)" bash scripts/test_lowest_versions.sh $(PYTEST_ARGS)

bench: setup
	$(VENV)/bin/python experiments/bench/reference_step.py $(CONFIG) $(ARGS) --write

clean:
	rm -rf $(VENV) .venv-lowest runs data .pytest_cache
