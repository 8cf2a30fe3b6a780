#!/usr/bin/env bash
# Boot the orchestrator controller node: Redis on 127.0.0.1 (unless ElastiCache), the package
# in /opt/orchestrator/venv, and `orchestrator controller start` as a systemd service running
# as an unprivileged user. Reads /etc/orchestrator/controller.env (written by the user data:
# settings and secret ARNs, never a secret). Debian 12 or Ubuntu 22.04+. Safe to run again.
set -euo pipefail

ENV_FILE=${ORCHESTRATOR_ENV_FILE:-/etc/orchestrator/controller.env}
VENV=/opt/orchestrator/venv
UNIT=/etc/systemd/system/orchestrator-controller.service
LOG_TAG=orchestrator-boot

log() { logger -t "$LOG_TAG" -- "$*" || true; echo "$LOG_TAG: $*"; }

if [ ! -r "$ENV_FILE" ]; then
    echo "$LOG_TAG: $ENV_FILE is missing: the user data writes it (see infra/controller.yaml)" >&2
    exit 1
fi
# shellcheck source=/dev/null
. "$ENV_FILE"
: "${ORCHESTRATOR_PACKAGE:?must name what pip installs}"
: "${ORCHESTRATOR_API__TOKEN_SECRET:?must name the API token secret}"

log "installing Python and Redis"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq python3 python3-venv python3-pip redis-server >/dev/null

if [ "${ORCHESTRATOR_REDIS_MODE:-local}" = "local" ]; then
    # Redis holds every job's state: only this host may reach it.
    sed -i -E 's/^#? *bind .*/bind 127.0.0.1 -::1/' /etc/redis/redis.conf
    sed -i -E 's/^#? *protected-mode .*/protected-mode yes/' /etc/redis/redis.conf
    sed -i -E 's/^#? *appendonly .*/appendonly yes/' /etc/redis/redis.conf
    systemctl enable redis-server
    systemctl restart redis-server
else
    systemctl disable --now redis-server || true
fi

if ! id orchestrator >/dev/null 2>&1; then
    useradd --system --home-dir /var/lib/orchestrator --create-home --shell /usr/sbin/nologin orchestrator
fi

if [ ! -x "$VENV/bin/orchestrator" ]; then
    log "installing $ORCHESTRATOR_PACKAGE"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --upgrade pip
    # the controller trains nothing: the CPU build of torch is enough (and 10x smaller)
    "$VENV/bin/pip" install --quiet --extra-index-url https://download.pytorch.org/whl/cpu \
        "$ORCHESTRATOR_PACKAGE"
fi

cat > "$UNIT" <<UNIT
[Unit]
Description=orchestrator controller (BidBrain, API, dashboard)
Wants=network-online.target
After=network-online.target redis-server.service

[Service]
User=orchestrator
Group=orchestrator
EnvironmentFile=$ENV_FILE
ExecStart=$VENV/bin/orchestrator controller start
Restart=on-failure
RestartSec=5
NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome=yes
PrivateTmp=yes
ReadWritePaths=/var/lib/orchestrator
WorkingDirectory=/var/lib/orchestrator

[Install]
WantedBy=multi-user.target
UNIT

systemctl daemon-reload
systemctl enable orchestrator-controller
systemctl restart orchestrator-controller
log "controller service started: journalctl -u orchestrator-controller -f"
