#!/usr/bin/env bash
# Make a docker daemon and arm64 emulation available on a Debian host (as root), for the image
# builds and tests: install Debian's docker.io, qemu-user-static, binfmt-support and debootstrap
# when missing, register qemu-aarch64 with binfmt_misc, and start dockerd unless one answers.
# dockerd uses overlay2, or vfs where overlay mounts fail (slower, and every layer a full copy).
set -euo pipefail
log() { echo "start-dockerd: $*" >&2; }
packages=(docker.io qemu-user-static binfmt-support debootstrap)

if ! dpkg -s "${packages[@]}" >/dev/null 2>&1; then
    log "installing ${packages[*]}"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${packages[@]}" >&2
fi

# arm64 emulation: the kernel's binfmt_misc, with Debian's qemu-aarch64 entry (fix-binary flag).
[ -e /proc/sys/fs/binfmt_misc/register ] || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
[ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || update-binfmts --enable qemu-aarch64

daemon_up() { docker info >/dev/null 2>&1; }

start() {
    local driver=$1
    log "starting dockerd (storage driver $driver)"
    nohup dockerd --storage-driver="$driver" >"/var/log/spark-edge-dockerd-$driver.log" 2>&1 &
    for _ in $(seq 60); do
        daemon_up && return 0
        kill -0 $! 2>/dev/null || break
        sleep 1
    done
    kill $! 2>/dev/null || true
    wait $! 2>/dev/null || true
    return 1
}

if daemon_up; then
    log "a docker daemon is already running"
    exit 0
fi
if start overlay2 || start vfs; then
    log "dockerd is up: $(docker info --format '{{.ServerVersion}}, {{.Driver}}')"
else
    log "dockerd did not start with overlay2 or vfs (see /var/log/spark-edge-dockerd-*.log)"
    exit 1
fi
