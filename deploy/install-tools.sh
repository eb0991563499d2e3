#!/usr/bin/env bash
# Install, as root on a Debian host, the OS tools the deploy/ tests need: Debian's `prometheus`
# (the server, for the scrape test, and `promtool`, for `check rules` and `test rules`) and
# `docker-compose` (`config` validates deploy/compose/compose.yaml; it needs no daemon).
# Only the binaries are used: the tests start their own server on a free port, so no service is
# enabled or started here (a host with systemd would otherwise start one on :9090).
set -euo pipefail
log() { echo "deploy/install-tools: $*" >&2; }
packages=(prometheus docker-compose)

if dpkg -s "${packages[@]}" >/dev/null 2>&1; then
    log "already installed: ${packages[*]}"
    exit 0
fi
log "installing ${packages[*]}"
# policy-rc.d exit 101: Debian's maintainer scripts must not start the packaged service.
policy=/usr/sbin/policy-rc.d
restore=no
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy" && restore=yes
fi
trap '[ "$restore" = no ] || rm -f "$policy"' EXIT
apt-get update -q
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${packages[@]}" >&2
log "$(promtool --version 2>&1 | head -1)"
