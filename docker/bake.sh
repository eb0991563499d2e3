#!/bin/sh
# The image's bake steps, run inside `docker build`.
#
#   bake.sh checkpoint   build $SPARK_EDGE_MODEL for $SPARK_EDGE_WEIGHT_PATH from the default model,
#                        or from /models/$MODEL when the MODEL build argument names one
#   bake.sh warm         fill the compile cache with `spark-edge warm` (the image's serve options, read
#                        from the same SPARK_EDGE_* variables) and keep it in $SPARK_EDGE_BAKED_CACHE
set -eu

checkpoint() {
    if [ -n "${MODEL:-}" ]; then
        spark-edge build --weight-path "$SPARK_EDGE_WEIGHT_PATH" --model "/models/$MODEL" --out "$SPARK_EDGE_MODEL"
    else
        spark-edge build --weight-path "$SPARK_EDGE_WEIGHT_PATH" --out "$SPARK_EDGE_MODEL"
    fi
    # Built as root here; served by the image's unprivileged user.
    chmod -R a+rX "$SPARK_EDGE_MODEL"
}

emulated() {
    # EMULATED=1 from docker/build-image.sh, which knows the host; without it (a plain `docker
    # build`), qemu-user before 8.1 shows an aarch64 process the host's x86 /proc/cpuinfo.
    [ "${EMULATED:-0}" = 1 ] || { [ "$(uname -m)" = aarch64 ] && grep -q '^flags' /proc/cpuinfo; }
}

not_warmed() {
    echo "$1" > "$SPARK_EDGE_BAKED_CACHE/NOT_WARMED"
    echo "bake: not warmed: $1"
}

aten_capability() {
    python3 -c 'import torch; print(torch.backends.cpu.get_cpu_capability())'
}

warm() {
    mkdir -p "$SPARK_EDGE_BAKED_CACHE"
    if emulated; then
        # Compiling under qemu takes hours, and would make code (and a cache stamp) for the
        # emulator's CPU rather than a real arm64 one.
        not_warmed "built under emulation on an x86-64 host, so not warmed"
        return
    fi
    if [ "$SPARK_EDGE_IMAGE_ISA" = avx2 ] && [ "$(aten_capability)" != AVX2 ]; then
        # Inductor would write AVX-512 code, which the CPUs this image is for cannot run (and the
        # cache's ISA stamp would never match there).
        not_warmed "built on a CPU with AVX-512, whose compiled code an AVX2 CPU cannot run"
        return
    fi
    # The same check `serve` makes at start (SPARK_EDGE_IMAGE_ISA): a build host whose CPU cannot
    # run this image's kernels (an AMX image built on a CPU without AMX) makes warm exit with 4.
    # Then the image ships without a compile cache and compiles on its first start instead.
    status=0
    spark-edge warm --model "$SPARK_EDGE_MODEL" 2> /tmp/warm.log || status=$?
    cat /tmp/warm.log >&2
    case $status in
    0)
        cp -a "$SPARK_EDGE_HOME/vllm-cache" "$SPARK_EDGE_BAKED_CACHE/vllm-cache"
        # The mapped weights (runtime/mapped_weights.py) stay in the image, beside the baked cache rather
        # than in it: the entrypoint copies the cache into the data folder, and every container of the image
        # maps this one read-only file instead (one copy of the weights in the node's page cache).
        for folder in "$SPARK_EDGE_BAKED_CACHE"/vllm-cache/*/; do
            if [ -d "${folder}mapped-weights" ]; then
                mkdir -p "$SPARK_EDGE_BAKED_CACHE/mapped-weights"
                mv "${folder}mapped-weights" "$SPARK_EDGE_BAKED_CACHE/mapped-weights/$(basename "$folder")"
            fi
        done
        # torch writes compiled artifacts 0600; the image's user copies them at start.
        chmod -R a+rX "$SPARK_EDGE_BAKED_CACHE"
        echo "bake: compile cache baked ($(du -sh "$SPARK_EDGE_BAKED_CACHE/vllm-cache" | cut -f1))"
        ;;
    4)
        grep 'spark-edge: error:' /tmp/warm.log | sed 's/^spark-edge: error: //' > "$SPARK_EDGE_BAKED_CACHE/NOT_WARMED"
        echo "bake: not warmed, the build host cannot run this image: $(cat "$SPARK_EDGE_BAKED_CACHE/NOT_WARMED")"
        ;;
    *)
        exit "$status"
        ;;
    esac
    rm -rf "$SPARK_EDGE_HOME" /tmp/warm.log
}

case "${1:?usage: bake.sh checkpoint|warm}" in
checkpoint) checkpoint ;;
warm) warm ;;
*) echo "bake.sh: unknown step $1" >&2; exit 2 ;;
esac
