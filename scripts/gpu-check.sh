#!/usr/bin/env bash
# The GPU check: trainer, packing, engine and weight-push numbers on one CUDA machine in < 10 min.
# Needs CUDA torch and the project installed (no vLLM, no network). Writes runs/gpu-check/gpu-report.{json,md}.
#   scripts/gpu-check.sh                  # the real check on GPU 0
#   scripts/gpu-check.sh --device cpu     # the same sections on small sizes (what CI runs)
# See docs/gpu-check.md. PYTHON picks the interpreter (default: .venv/bin/python if present, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
exec "$PYTHON" -m bench.gpu "$@"
