#!/usr/bin/env bash
# Build spark-edge:<isa> from Dockerfile.<isa> (x86: followed by docker/x86.Dockerfile), or keep the existing one when its inputs are unchanged.
#
#   docker/build-image.sh avx512|amx|avx2|arm     prints the image's tag
#
#   BASE_IMAGE=debian:bookworm-slim   use a registry image instead of the debootstrap base
#   MODEL=/path/to/model.gguf|folder  bake another model (SERVED_NAME: its API name; default
#                                     derived from the file or folder name, as spark-edge does)
#   IMAGE_TAG=...                     another tag than spark-edge:<isa>
#
# The build context is assembled under build/context/<isa>/ (hard links, so it costs no copy):
# just what the Dockerfile reads, one architecture's wheelhouse. A hash of that context, the base
# image's ID and the build arguments is stored as the image label io.spark-edge.inputs-hash; the
# same hash on an existing image means nothing would change, and the build is skipped.
# arm: nothing heavy runs under qemu. The host unpacks the aarch64 wheels (docker/arm64/sitepackages.py)
# and builds the checkpoint (`spark-edge build`; weights do not depend on the CPU), and the context
# carries those instead of the wheelhouse. They run niced, outside the engine lock (a no-op when
# up to date, and nothing there is timed).
# Builds take the machine-wide engine lock ($SPARK_EDGE_ENGINE_LOCK, default /tmp/spark_edge_engine.lock): they compile and warm
# the model, and two such jobs at once on a small machine make both slow. --shm-size: vLLM's
# engine talks to its worker through a 160 MiB shared-memory ring (docker's default /dev/shm is 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
isa=${1:?usage: build-image.sh avx512|amx|avx2|arm}
python=${PYTHON:-.venv/bin/python}
# The image's build arguments (ISA, weight path, architecture, served name) from spark-edge's registry
registry_args=$("$python" scripts/image_recipe.py image-args "$isa") || exit 2
registry_arg() { sed -n "s/^$1=//p" <<<"$registry_args"; }
arch=$(registry_arg ARCH)
tag=${IMAGE_TAG:-spark-edge:$isa}
context=build/context/$isa

log() { echo "build-image[$isa]: $*" >&2; }

docker info >/dev/null 2>&1 || { echo "build-image: no docker daemon is reachable" >&2; exit 1; }

base=${BASE_IMAGE:-$(docker/build-base.sh "$arch")}
docker/wheelhouse.sh "$arch"

served_name() {
    # The name spark-edge itself gives a model source (the API's model id).
    "$python" -c 'import sys; from pathlib import Path; from spark_edge.checkpoints.sources import model_id
print(model_id(Path(sys.argv[1])))' "$1"
}

arm64_host_build() {
    # build/arm64/: site-packages and project (each skipped when its stamp matches), and the
    # checkpoint for the Dockerfile's WEIGHT_PATH (the builder leaves an up-to-date one alone).
    local weight_path
    weight_path=$(registry_arg WEIGHT_PATH)
    nice -n 19 "$python" docker/arm64/sitepackages.py "build/wheelhouse/$arch" build/arm64
    nice -n 19 "$python" -m spark_edge.cli build --weight-path "$weight_path" ${MODEL:+--model "$MODEL"} \
        --out "build/arm64/models/$arm64_served" >&2
    chmod -R a+rX "build/arm64/models/$arm64_served"
}

assemble_context() {
    rm -rf "$context"
    mkdir -p "$context/docker"
    cp -a constraints.txt pyproject.toml README.md "$context/"
    # the image's own file (what it is), followed by its shared recipe if it has one (x86: how it is built)
    "$python" scripts/image_recipe.py dockerfile "$isa" >"$context/Dockerfile.$isa"
    cp -a src "$context/src"
    find "$context/src" \( -name __pycache__ -o -name '*.egg-info' \) -prune -exec rm -rf {} +
    cp -a docker/*.sh docker/*.py docker/os-packages.txt "$context/docker/"
    if [ "$arch" = arm64 ]; then
        mkdir -p "$context/build/arm64/models" "$context/docker/arm64"
        cp -al build/arm64/site-packages build/arm64/project build/arm64/site-packages.stamp "$context/build/arm64/"
        cp -al "build/arm64/models/$arm64_served" "$context/build/arm64/models/"
        cp -a docker/arm64/spark-edge "$context/docker/arm64/"
        return
    fi
    mkdir -p "$context/build/wheelhouse"
    cp -al "build/wheelhouse/$arch" "$context/build/wheelhouse/$arch"
    mkdir -p "$context/docker/models"
    if [ -n "${MODEL:-}" ]; then
        cp -al "$MODEL" "$context/docker/models/" 2>/dev/null || cp -a "$MODEL" "$context/docker/models/"
    fi
}

torch_wheel=$(find "build/wheelhouse/$arch" -name 'torch-*.whl' -printf '%f\n' | head -1)
build_args=(--build-arg "BASE_IMAGE=$base" --build-arg "TORCH_VERSION=$(echo "$torch_wheel" | cut -d- -f2)")
while IFS= read -r arg; do
    case "$arg" in SERVED_NAME=*) ;; *) build_args+=(--build-arg "$arg") ;; esac
done <<<"$registry_args"
served=${SERVED_NAME:-$(if [ -n "${MODEL:-}" ]; then served_name "$MODEL"; else registry_arg SERVED_NAME; fi)}
build_args+=(--build-arg "SERVED_NAME=$served")
if [ "$arch" = arm64 ]; then
    arm64_served=$served
elif [ -n "${MODEL:-}" ]; then
    build_args+=(--build-arg "MODEL=$(basename "$MODEL")")
fi

inputs_hash() {
    # Wheels by name and size (a wheel's name carries its version); everything else by content,
    # except arm64's unpacked site-packages (4 GB): by its stamp, a hash of what it is made from.
    (
        cd "$context"
        find . -type f -name '*.whl' -printf '%p %s\n' | sort
        find . -type f ! -name '*.whl' ! -path './build/arm64/site-packages/*' -print0 | sort -z | xargs -0 sha256sum
    ) | cat - <(docker image inspect --format '{{.Id}}' "$base") <(printf '%s\n' "${build_args[@]}") \
      | sha256sum | cut -c1-16
}

[ "$arch" != arm64 ] || arm64_host_build
assemble_context
hash=$(inputs_hash)
have=$(docker image inspect --format '{{index .Config.Labels "io.spark-edge.inputs-hash"}}' "$tag" 2>/dev/null || true)
if [ "$have" = "$hash" ]; then
    log "$tag is up to date (inputs $hash)"
    echo "$tag"
    exit 0
fi

platform=()
[ "$arch" = amd64 ] || platform=(--platform "linux/$arch")
# Said, not guessed inside the build: qemu 8.1 and newer emulate /proc/cpuinfo for the guest.
host_arch=$(dpkg --print-architecture 2>/dev/null || uname -m)
[ "$host_arch" = "$arch" ] || build_args+=(--build-arg "EMULATED=1")
# SPARK_EDGE_ENGINE_LOCK= (empty): the caller already holds the lock (flock(1) on an ancestor would
# otherwise make this wait for itself forever).
lock=${SPARK_EDGE_ENGINE_LOCK-/tmp/spark_edge_engine.lock}
ancestor_holds() {  # is a `flock ... $lock ...` among this script's ancestors?
    local pid=$PPID args
    while [ "$pid" -gt 1 ] 2>/dev/null; do
        args=$(tr '\0' '\n' < "/proc/$pid/cmdline" 2>/dev/null || true)
        if [ "$(basename "$(head -1 <<<"$args")")" = flock ] && grep -qxF "$lock" <<<"$args"; then
            return 0
        fi
        pid=$(awk '/^PPid:/ {print $2}' "/proc/$pid/status" 2>/dev/null || echo 0)
    done
    return 1
}
if [ -n "$lock" ] && ancestor_holds; then
    log "an ancestor process holds $lock already"
    lock=""
fi
log "building $tag (inputs $hash) from $base${lock:+; waiting for the engine lock $lock}"
if [ -n "$lock" ]; then
    exec 9>>"$lock"
    flock 9
fi
start=$SECONDS
previous=$(docker image inspect --format '{{.Id}}' "$tag" 2>/dev/null || true)
build_log=$(mktemp)
trap 'rm -f "$build_log"' EXIT
docker build --force-rm --network host --shm-size 1g "${platform[@]}" -f "$context/Dockerfile.$isa" \
    "${build_args[@]}" --build-arg "INPUTS_HASH=$hash" -t "$tag" "$context" | tee "$build_log" >&2
[ -z "$lock" ] || flock -u 9
remove_stale_stages() {
    # Each build leaves its stages' images (requirements, deps, checkpoint, warm) untagged: the builder's
    # cache, 4 GB apiece. This build's own are the cache from now on; those of earlier builds are removed
    # (a CI run that had filled the disk with them failed). Only images carrying our recipe label.
    local used id removed=0
    used=$(sed -n 's/^ ---> \([0-9a-f]\{12\}\)$/\1/p' "$build_log" | sort -u)
    for id in $(docker images -q --filter dangling=true --filter label=io.spark-edge.recipe); do
        grep -qxF "$id" <<<"$used" && continue
        docker image rm "$id" >/dev/null 2>&1 && removed=$((removed + 1))
    done
    [ "$removed" -eq 0 ] || log "removed $removed stage images of earlier builds"
}
remove_stale_stages
# The image this tag named before is now untagged: 3-5 GB per rebuild that nothing uses. Removed unless
# a container or another tag still holds it (then docker refuses, and that is fine).
if [ -n "$previous" ] && [ "$previous" != "$(docker image inspect --format '{{.Id}}' "$tag")" ]; then
    docker image rm "$previous" >/dev/null 2>&1 && log "removed the previous $tag (${previous:7:12})" || true
fi
log "built $tag in $((SECONDS - start)) s (lock held), $(docker image inspect --format '{{.Size}}' "$tag" | numfmt --to=iec)"
echo "$tag"
