#!/usr/bin/env bash
# Download, here (a machine that reaches PyPI), the wheels that a lent GPU machine lacks for the
# GPU check (docs/gpu-check.md), into .whl/ (git-ignored). Such a machine has no network, Python
# 3.12, CUDA torch, transformers, numpy, msgpack, httpx and sympy, and no pydantic, fastapi,
# uvicorn, tenacity or redis. Every version comes from uv.lock, so the check imports exactly what
# the project is tested with; torch and transformers are the machine's own.
#
#   scripts/gpu-wheels.sh            # -> .whl/*.whl (cp312, manylinux x86_64)
#   scripts/gpu-preamble.sh          # on the GPU machine: install them into /tmp/site, run the check
#
# PYTHON_VERSION (default 3.12) picks the wheels' Python. The list below is every distribution
# the check's import closure needs beyond that machine's own packages (tests/integration/test_gpu_wheels.py
# keeps it complete).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON_VERSION:-3.12}"
DEST="${WHEEL_DIR:-.whl}"
PIP="${PIP:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 ) -m pip}"

# The distributions the check needs that a lent machine lacks, or holds at a version the project's
# generated code refuses (protobuf/grpcio: the gencode checks the runtime's version).
GPU_WHEELS=(
  pydantic pydantic-core annotated-types typing-inspection typing-extensions
  fastapi starlette annotated-doc uvicorn
  tenacity redis
  protobuf grpcio
  zstandard lz4
)

mkdir -p "$DEST"
rm -f "$DEST"/*.whl
specs=()
for name in "${GPU_WHEELS[@]}"; do
  version="$(python3 - "$name" <<'EOF'
import sys, tomllib
want = sys.argv[1].replace("_", "-").lower()
with open("uv.lock", "rb") as f:
    lock = tomllib.load(f)
for pkg in lock["package"]:
    if pkg["name"].replace("_", "-").lower() == want:
        print(pkg["version"])
        break
else:
    sys.exit(f"gpu-wheels: {want} is not in uv.lock")
EOF
)"
  specs+=("$name==$version")
done
echo "gpu-wheels: ${specs[*]}" >&2
platforms=()
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
$PIP download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
  "${platforms[@]}" -d "$DEST" "${specs[@]}"
ls -1 "$DEST"/*.whl | wc -l | xargs echo "gpu-wheels: wheels in $DEST:" >&2
du -sh "$DEST" >&2
