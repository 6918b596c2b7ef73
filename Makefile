# Two commands matter: `make demo` (the learning loop on this CPU) and `make test` (both test tiers).
# Each sets up what it needs on a fresh machine: the project venv (.venv) and the vLLM CPU venv.

PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The torch every venv and image gets (trainer/demo/vllm_cpu.py TORCH_SPEC and the Dockerfile say the same).
TORCH := torch==2.13.0
EXTRAS := train,dev,judge,demo

.PHONY: setup demo lint test test-fast test-e2e vllm-setup fixtures constraints clean

setup: $(STAMP)

# torch first, pinned to the CPU wheel on disk, so the `train` extra's torch range pulls no CUDA build. Both installs
# take constraints.txt, so this venv has the versions CI tested, not whatever is newest today.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt $(TORCH)
	$(PY) -m pip install -q -c constraints.txt -e '.[$(EXTRAS)]'
	touch $(STAMP)

# Regenerate constraints.txt: install the project into a scratch venv WITHOUT the old constraints (so it gets the
# newest versions pyproject.toml allows), freeze it, keep the file's header comment and the torch pin, and delete the
# scratch venv. Run it when pyproject.toml's dependencies change or to move to newer releases on purpose; then run
# `make test` on the new set and commit constraints.txt with the change that needed it.
CONSTRAINTS_VENV := build/constraints-venv
constraints:
	rm -rf $(CONSTRAINTS_VENV)
	$(PYTHON) -m venv $(CONSTRAINTS_VENV)
	$(CONSTRAINTS_VENV)/bin/python -m pip install -q --upgrade pip
	$(CONSTRAINTS_VENV)/bin/python -m pip install -q $(TORCH)
	$(CONSTRAINTS_VENV)/bin/python -m pip install -q -e '.[$(EXTRAS)]'
	{ grep '^#' constraints.txt; \
	  $(CONSTRAINTS_VENV)/bin/python -m pip freeze --exclude-editable | sed 's/^torch==.*/$(TORCH)/'; } > constraints.txt.new
	mv constraints.txt.new constraints.txt
	rm -rf $(CONSTRAINTS_VENV)

# Extra flags for the demo, e.g. `make demo DEMO_ARGS="--steps 20"` (see `trajgate demo --help`).
DEMO_ARGS ?=
demo: $(STAMP)
	$(PY) -m gateway.cli demo $(DEMO_ARGS)

# ruff (rules in pyproject.toml; the tree is not reformatted), the layer contract (tests/test_layers.py), that every
# import is declared (tests/test_dependencies.py), and mypy --strict ([tool.mypy]) on all of gateway/ and trainer/.
MYPY_PACKAGES := gateway trainer
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q -p no:cacheprovider tests/test_layers.py tests/test_dependencies.py
	$(MAKE) -s mypy

mypy: $(STAMP)
	$(PY) -m mypy $(MYPY_PACKAGES)

test: test-fast test-e2e

test-fast: $(STAMP)
	$(PY) -m pytest -m "not e2e" --durations=15

test-e2e: $(STAMP) vllm-setup
	$(PY) -m pytest -m e2e tests/e2e --durations=0

vllm-setup: $(STAMP)
	$(PY) -m trainer.demo.vllm_cpu setup
	$(PY) -m trainer.demo.vllm_cpu smollm2
	$(PY) -m trainer.demo.vllm_cpu tiny

fixtures: $(STAMP) vllm-setup
	$(PY) scripts/record_fixtures.py

clean:
	rm -rf $(VENV) .pytest_cache
