# Two commands set everything up on a fresh machine:
#   make train   create .venv (Python >= 3.12), install angel_jax, train the main job (experiments/gpt_tiny.yaml)
#   make test    the same set-up, then the test suite
# PYTHON=/path/to/python3.12 picks the interpreter; CONFIG=... and ARGS="key=value ..." change the job.
SHELL := /bin/bash
VENV := .venv
CONFIG ?= experiments/gpt_tiny.yaml
ARGS ?=
PYTEST_ARGS ?=
STAMP := $(VENV)/.installed

.PHONY: train test venv bench clean

$(STAMP): pyproject.toml constraints.txt
	@py=$$(PYTHON="$(PYTHON)" scripts/find_python.sh) || exit 1; \
	echo "using $$py"; \
	rm -rf $(VENV) && "$$py" -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -c constraints.txt -e '.[dev]'
	@touch $(STAMP)

venv: $(STAMP)

train: $(STAMP)
	$(VENV)/bin/angel-jax train $(CONFIG) $(ARGS)

# Property tests draw the same examples every run (HYPOTHESIS_PROFILE=explore draws new ones); the 15 slowest
# tests are listed at the end so that a slow-down shows.
test: $(STAMP)
	HYPOTHESIS_PROFILE=$${HYPOTHESIS_PROFILE:-ci} $(VENV)/bin/python -m pytest -q --durations=15 $(PYTEST_ARGS)

bench: $(STAMP)
	$(VENV)/bin/python experiments/bench/reference_step.py $(CONFIG) $(ARGS)

clean:
	rm -rf $(VENV) runs data .pytest_cache
