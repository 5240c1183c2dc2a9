#!/usr/bin/env bash
# System tools the test suite runs for real: redis-server (queue tests) and Prometheus's
# promtool/prometheus (deployment tests). Installed from Debian's packages when missing and
# we are root; otherwise say what is missing (the tests that need it fail with that message).
set -euo pipefail
need=()
command -v redis-server >/dev/null || need+=(redis-server)
command -v promtool >/dev/null || need+=(prometheus)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null; }
else
  echo "warning: missing ${need[*]} (install the Debian packages); the tests that need them will fail" >&2
fi
