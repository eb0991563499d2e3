#!/usr/bin/env bash
# Build spark-edge-prometheus:bookworm-<arch> (Dockerfile.prometheus beside this script) on the debootstrap
# base of the spark-edge images, tag it spark-edge-prometheus:bookworm (compose.yaml's default) and print it.
# A build whose base and recipe are unchanged is docker's cache: seconds.
#
#   deploy/compose/build-prometheus-image.sh [amd64|arm64]     default: this host's architecture
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
arch=${1:-$(dpkg --print-architecture)}
base=${BASE_IMAGE:-$("$here/../../docker/build-base.sh" "$arch")}
tag="spark-edge-prometheus:bookworm-$arch"
docker build --platform "linux/$arch" --build-arg "BASE_IMAGE=$base" -t "$tag" \
    -f "$here/Dockerfile.prometheus" "$here" >&2
docker tag "$tag" spark-edge-prometheus:bookworm
echo "$tag"
