#!/usr/bin/env bash
# Boot an orchestrator worker node (spot or on-demand): install the package unless the AMI
# has it baked in, then run `orchestrator worker start` as a systemd service. That command
# reads the instance's tags from the metadata service (IMDSv2; the launch template enables
# instance tags), joins the job named in its orchestrator:job-id tag and watches for the spot
# interruption notice. Reads /etc/orchestrator/worker.env (written by the user data).
#
# AMI-agnostic path: a Debian 12 or Amazon Linux 2023 AMI; this script installs Python 3.11+
# and the package. AMI-baked path (GPU AMIs with their NVIDIA driver): run this script once
# while building the AMI (it installs into /opt/orchestrator/venv), and at boot it only
# (re)starts the service.
set -euo pipefail

ENV_FILE=${ORCHESTRATOR_ENV_FILE:-/etc/orchestrator/worker.env}
VENV=/opt/orchestrator/venv
UNIT=/etc/systemd/system/orchestrator-worker.service
LOG_TAG=orchestrator-worker-boot

log() { logger -t "$LOG_TAG" -- "$*" || true; echo "$LOG_TAG: $*"; }

if [ ! -r "$ENV_FILE" ]; then
    echo "$LOG_TAG: $ENV_FILE is missing: the user data writes it (see infra/controller.yaml)" >&2
    exit 1
fi
# shellcheck source=/dev/null
. "$ENV_FILE"
: "${ORCHESTRATOR_PACKAGE:?must name what pip installs}"

# a Python 3.11+ that can make a venv (Debian splits ensurepip into python3-venv)
python_311() {
    for candidate in python3.13 python3.12 python3.11 python3; do
        if command -v "$candidate" >/dev/null 2>&1 &&
            "$candidate" -c 'import sys, ensurepip, venv; sys.exit(sys.version_info < (3, 11))' \
                2>/dev/null; then
            command -v "$candidate"
            return 0
        fi
    done
    return 1
}

if ! id orchestrator >/dev/null 2>&1; then
    useradd --system --home-dir /var/lib/orchestrator --create-home --shell /usr/sbin/nologin \
        orchestrator
fi

if [ ! -x "$VENV/bin/orchestrator" ]; then
    if ! python_311 >/dev/null; then
        log "installing Python 3.11+"
        if command -v apt-get >/dev/null 2>&1; then
            export DEBIAN_FRONTEND=noninteractive
            apt-get update -qq
            apt-get install -y -qq python3 python3-venv python3-pip >/dev/null
        elif command -v dnf >/dev/null 2>&1; then
            dnf install -y -q python3.11 python3.11-pip
        else
            log "no apt-get or dnf: bake Python 3.11+ and $VENV into the AMI"
            exit 1
        fi
    fi
    if ! PYTHON=$(python_311); then
        log "no Python 3.11+ with venv on this AMI: use Debian 12, Amazon Linux 2023 or bake one"
        exit 1
    fi
    log "installing $ORCHESTRATOR_PACKAGE with $PYTHON"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --upgrade pip
    "$VENV/bin/pip" install --quiet "$ORCHESTRATOR_PACKAGE"
fi

cat > "$UNIT" <<UNIT
[Unit]
Description=orchestrator worker (AgileML node and spot-notice watcher)
Wants=network-online.target
After=network-online.target

[Service]
User=orchestrator
Group=orchestrator
# GPU device files are world-usable with NVIDIA's driver, or owned by the video group
SupplementaryGroups=video
EnvironmentFile=$ENV_FILE
ExecStart=$VENV/bin/orchestrator worker start
Restart=on-failure
RestartSec=5
NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome=yes
PrivateTmp=yes
ReadWritePaths=/var/lib/orchestrator
WorkingDirectory=/var/lib/orchestrator
# an eviction notice gives two minutes: leave time for the hand-off on stop
TimeoutStopSec=100

[Install]
WantedBy=multi-user.target
UNIT

systemctl daemon-reload
systemctl enable orchestrator-worker
systemctl restart orchestrator-worker
log "worker service started: journalctl -u orchestrator-worker -f"
