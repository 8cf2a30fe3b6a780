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
# torch 2.13.0 first, unless a torch is installed already (yours, e.g. a CUDA build, is kept):
# the package accepts a range, and an open range would fetch the newest release (a CUDA build of
# several GB on Linux); where a CPU build of 2.13.0 lies in pip's find-links, pip takes that
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    "$PYTHON" -m pip install --quiet "torch==2.13.0"
fi
# the offline world (demo, local up) and plots, plus any extras asked for (EXTRAS="dev" or "[dev]")
extras="offline,plot"
requested="${EXTRAS:-}"
requested="${requested#[}"
requested="${requested%]}"
if [ -n "$requested" ]; then extras="$extras,$requested"; fi
"$PYTHON" -m pip install --quiet -e ".[$extras]"
echo "set up: $(redis-server --version | cut -d' ' -f1-3); $("$PYTHON" -m orchestrator --version)"
