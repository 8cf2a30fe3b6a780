#!/usr/bin/env bash
# Set up a fresh Debian/Ubuntu machine for orchestrator: Redis (Debian's package) and the
# package itself with its Python dependencies. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")"

if ! command -v redis-server >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi

PYTHON=${PYTHON:-python3}
"$PYTHON" -m pip install --quiet --upgrade pip
"$PYTHON" -m pip install --quiet -e ".${EXTRAS:-}"
echo "set up: $(redis-server --version | cut -d' ' -f1-3); $("$PYTHON" -m orchestrator --version)"
