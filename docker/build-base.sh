#!/usr/bin/env bash
# Build a minimal Debian bookworm base image with debootstrap and `docker import` it, for hosts
# that reach Debian's archive but no container registry. With a registry, skip this and pass
# BASE_IMAGE=debian:bookworm-slim to the image build instead.
#
#   docker/build-base.sh amd64|arm64     prints the image's tag
#
# The tag carries a hash of the recipe (os-packages.txt, suite, architecture, recipe version), and
# the root filesystem tarball is kept under $SPARK_EDGE_IMAGE_CACHE by the same key: arm64's
# second stage runs under qemu and takes minutes, so a later build (or CI run on the same
# machine) imports the tarball instead of bootstrapping again.
# The mirror is the one this host's apt uses, unless DEBIAN_MIRROR names another.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
arch=${1:?usage: build-base.sh amd64|arm64}
suite=bookworm
cache_dir=${SPARK_EDGE_IMAGE_CACHE:-/var/cache/spark-edge-images}

case "$arch" in
    amd64|arm64) ;;
    *) echo "build-base: unknown architecture $arch (amd64 or arm64)" >&2; exit 2 ;;
esac

log() { echo "build-base[$arch]: $*" >&2; }

host_mirror() {
    # deb822 sources (bookworm's default) first, then the one-line format.
    local uri
    uri=$(awk '/^URIs:/ && $2 ~ /\/debian\/?$/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
    [ -n "$uri" ] || uri=$(awk '$1 == "deb" && $3 == "'"$suite"'" {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
    [ -n "$uri" ] || { echo "build-base: no Debian mirror found in /etc/apt; set DEBIAN_MIRROR" >&2; exit 1; }
    echo "$uri"
}

packages=$(grep -v '^#' "$here/os-packages.txt" | paste -sd, -)
# Bump when bootstrap() changes what goes into the root filesystem (not for plumbing changes).
recipe=1
key=$(cat "$here/os-packages.txt" <(echo "$suite $arch recipe $recipe") | sha256sum | cut -c1-12)
tag="spark-edge-base:$suite-$arch-$key"
tarball="$cache_dir/base-$suite-$arch-$key.tar.gz"

if docker image inspect "$tag" >/dev/null 2>&1; then
    log "$tag is present"
    # The Dockerfiles' default BASE_IMAGE, for a plain `docker build -f Dockerfile.<isa> .`.
    docker tag "$tag" "spark-edge-base:$suite-$arch"
    echo "$tag"
    exit 0
fi

bootstrap() {
    local root=$1 mirror
    mirror=${DEBIAN_MIRROR:-$(host_mirror)}
    if [ "$arch" = "$(dpkg --print-architecture)" ]; then
        debootstrap --variant=minbase --include="$packages" "$suite" "$root" "$mirror" >&2
    else
        # Foreign architecture: unpack here, then run the packages' scripts under qemu-user
        # (binfmt_misc with the fix-binary flag, so nothing needs copying into the root).
        [ -e "/proc/sys/fs/binfmt_misc/qemu-aarch64" ] || {
            echo "build-base: binfmt_misc has no qemu-aarch64 entry: install qemu-user-static and" \
                 "binfmt-support, mount binfmt_misc and run update-binfmts --enable qemu-aarch64" >&2; exit 1; }
        debootstrap --arch="$arch" --foreign --variant=minbase --include="$packages" "$suite" "$root" "$mirror" >&2
        chroot "$root" /debootstrap/debootstrap --second-stage >&2
    fi
    # What an image does not need: package archives and lists, logs, docs.
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/var/log/* \
           "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/*
}

if [ ! -f "$tarball" ]; then
    mkdir -p "$cache_dir"
    root=$(mktemp -d /var/tmp/spark-edge-rootfs.XXXXXX)
    trap 'rm -rf "$root"' EXIT
    start=$SECONDS
    log "debootstrap $suite ($packages)"
    bootstrap "$root"
    tar --numeric-owner -C "$root" -czf "$tarball.tmp" .
    mv "$tarball.tmp" "$tarball"
    log "root filesystem built in $((SECONDS - start)) s: $tarball"
fi

image_from_tarball() {
    if [ "$arch" = "$(dpkg --print-architecture)" ]; then
        docker import \
            --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
            --change 'ENV LANG=C.UTF-8' \
            --change 'CMD ["/bin/bash"]' \
            --message "debootstrap --variant=minbase $suite $arch + $packages" \
            "$tarball" "$tag" >&2
        return
    fi
    # A foreign architecture: docker 20.10's import ignores --platform and records the daemon's
    # own, so the image would claim amd64. A FROM scratch build records the platform it is given.
    local ctx
    ctx=$(mktemp -d /var/tmp/spark-edge-base-ctx.XXXXXX)
    ln "$tarball" "$ctx/rootfs.tar.gz" 2>/dev/null || cp "$tarball" "$ctx/rootfs.tar.gz"
    printf '%s\n' 'FROM scratch' 'ADD rootfs.tar.gz /' \
        'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
        'CMD ["/bin/bash"]' > "$ctx/Dockerfile"
    docker build -q --platform "linux/$arch" -t "$tag" "$ctx" >&2
    rm -rf "$ctx"
}

image_from_tarball
docker tag "$tag" "spark-edge-base:$suite-$arch"
log "imported $tag"
echo "$tag"
