#!/bin/sh
# The images' entrypoint: prepare the writable data folder, then hand over to `spark-edge`.
#
# The checkpoint and the compile cache baked at build time live under /opt (read-only with
# `docker run --read-only`); vLLM writes to its compile cache, so `serve` and `warm` run with
# $SPARK_EDGE_HOME on a volume or tmpfs, and the baked cache is copied there, per weight-path
# folder, when that folder is empty or holds a cache stamped for something else (an older image's,
# left in a kept volume).
# With no --model, `serve` and `warm` read the baked checkpoint from $SPARK_EDGE_MODEL themselves.
set -eu

log() { echo "spark-edge-entrypoint: $*" >&2; }

now_ms() { echo $(( $(date +%s%N) / 1000000 )); }

writable_home() {
    if ! mkdir -p "$SPARK_EDGE_HOME/vllm-cache" 2>/dev/null || [ ! -w "$SPARK_EDGE_HOME/vllm-cache" ]; then
        log "$SPARK_EDGE_HOME is not writable. With a read-only root filesystem, mount a volume or a tmpfs" \
            "there: docker run --read-only --tmpfs /tmp:exec --shm-size 512m -v spark-edge-cache:$SPARK_EDGE_HOME ..."
        exit 1
    fi
}

seed_cache() {
    baked=$SPARK_EDGE_BAKED_CACHE cache=$SPARK_EDGE_HOME/vllm-cache stamp=spark_edge_cache_stamp.json
    if [ -f "$baked/NOT_WARMED" ]; then
        log "this image has no baked compile cache ($(cat "$baked/NOT_WARMED")): this start compiles the" \
            "model (minutes) into $cache; keep that folder on a volume so later starts reuse it"
        return
    fi
    [ -d "$baked/vllm-cache" ] || return 0
    # One cache per weight path, each stamped in its own folder (what it was compiled for)
    for folder in "$baked/vllm-cache"/*/; do
        [ -d "$folder" ] || continue
        kept=$cache/$(basename "$folder")
        if [ -f "$folder$stamp" ] && [ -f "$kept/$stamp" ] && ! cmp -s "$folder$stamp" "$kept/$stamp"; then
            log "$kept holds a compile cache made for something else; replacing it with this image's"
            rm -rf "$kept"
        fi
    done
    start=$(now_ms)
    # -n: what the folder already holds (from an earlier start of this image) is kept as it is.
    cp -R -n "$baked/vllm-cache/." "$cache/"
    log "compile cache seeded from the image in $(( $(now_ms) - start )) ms"
}

[ "$#" -gt 0 ] || set -- serve
case "$1" in
serve|warm)
    writable_home
    seed_cache
    ;;
esac
exec spark-edge "$@"
