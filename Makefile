# One entry point for humans and CI. Every target bootstraps .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test lint typecheck unit golden demo bench clean

setup: $(STAMP)

# Re-install only when the dependency definitions change (idempotent).
# torch==2.13.0 is named first so pip takes the CPU build (no multi-GB CUDA download).
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The second run holds the shim to its promise, Python 3.9 and the standard
# library alone (no site-packages: torch and transformers are the user's).
typecheck: setup
	$(BIN)/mypy
	$(BIN)/mypy --python-version 3.9 --no-site-packages --no-warn-unused-ignores shim

unit: setup
	$(BIN)/pytest -m 'not slow' $(PYTEST_ARGS)

test: lint typecheck
	$(BIN)/pytest $(PYTEST_ARGS)

# Regenerate every golden file after an intended change of output, in one run:
# the injector's pods and results and the CLI's whole-command outputs (every
# test that compares with a golden is marked `golden`, see tests/webhook/conftest.py).
golden: setup
	$(BIN)/pytest -q -m golden --update-golden tests/webhook

demo: setup
	$(BIN)/jitckpt demo

bench: setup
	$(BIN)/python -m bench.run_all

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
