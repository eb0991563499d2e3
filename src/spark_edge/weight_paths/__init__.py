"""Weight paths: how a checkpoint's weights are stored and which kernel runs them.

Each path has a writer module here that fills a checkpoint folder from a source, one tensor at a time,
and returns what `config.json` must add (e.g. a `quantization_config`). What else a path is (its vLLM
method, plan factors, default group, host requirement) is recorded in spark_edge.registry.
"""

from __future__ import annotations

from spark_edge.registry import WEIGHT_PATHS, WeightWriter

NAMES = tuple(WEIGHT_PATHS)


def writers() -> dict[str, WeightWriter]:
    """Weight path name -> writer (imported on use: quantizers pull in torch)."""
    return {name: path.write() for name, path in WEIGHT_PATHS.items()}
