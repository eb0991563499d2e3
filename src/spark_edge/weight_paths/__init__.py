"""Weight paths: how a checkpoint's weights are stored and which kernel runs them.

Each path has a writer that fills a checkpoint folder from a source, one tensor at a
time, and returns what `config.json` must add (e.g. a `quantization_config`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from spark_edge.checkpoints.sources import CheckpointSource

WeightWriter = Callable[["CheckpointSource", Path, dict[str, Any]], dict[str, Any]]


def writers() -> dict[str, WeightWriter]:
    """Weight path name -> writer (imported lazily: quantizers pull in torch)."""
    from spark_edge.weight_paths.bf16 import write_bf16
    from spark_edge.weight_paths.w4a8 import write_w4a8
    from spark_edge.weight_paths.w4a16 import write_w4a16

    return {"bf16": write_bf16, "w4a16": write_w4a16, "w4a8": write_w4a8}


# bf16: the source's weights cast to bfloat16, unquantized.
# w4a16: 4-bit group-wise weights, bf16 activations (vLLM quantization "cpu_int4").
# w4a8: symmetric 4-bit GPTQ weights for vLLM's own CPU kernel (AMX W4A8; "gptq").
NAMES = ("bf16", "w4a16", "w4a8")
