#!/usr/bin/env bash
# Run the GPU check on a lent machine as it is: no network, its own CUDA torch and transformers,
# the missing wheels carried in .whl/ (made here by scripts/gpu-wheels.sh). Installs them into a
# private --target (nothing of the machine's own is touched), puts it and the checkout first on
# PYTHONPATH, and runs `python -m bench.gpu` with the arguments given.
#
#   scripts/gpu-preamble.sh --out "$OUT/gpu-check" --deadline-s 420
set -euo pipefail
cd "$(dirname "$0")/.."
SITE="${GPU_SITE:-/tmp/retool-site}"
PYTHON="${PYTHON:-python3}"
if ! compgen -G ".whl/*.whl" >/dev/null; then
  echo "gpu-preamble: no wheels in .whl/ (run scripts/gpu-wheels.sh where PyPI is reachable)" >&2
  exit 2
fi
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$SITE" .whl/*.whl
export PYTHONPATH="$SITE:$(pwd -P)${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" - <<'EOF'
import importlib, sys
import torch, transformers
print(f"gpu-preamble: python {sys.version.split()[0]}, torch {torch.__version__} "
      f"(cuda {torch.version.cuda}, available {torch.cuda.is_available()}), "
      f"transformers {transformers.__version__}", file=sys.stderr)
for name in ("pydantic", "fastapi", "grpc", "google.protobuf", "services.trainer.step",
             "services.rollout.engine.hf", "services.rollout.weights.server", "bench.gpu.common"):
    importlib.import_module(name)
EOF
exec "$PYTHON" -m bench.gpu "$@"
