"""Where spark-edge keeps what it builds: checkpoints and caches under one data folder."""

from __future__ import annotations

import os
from pathlib import Path

from spark_edge.environment import HOME


def spark_edge_home() -> Path:
    """$SPARK_EDGE_HOME, else $XDG_CACHE_HOME/spark-edge, else ~/.cache/spark-edge."""
    explicit = HOME.get()
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "spark-edge"


def checkpoint_dir(model_id: str, weight_path: str) -> Path:
    return spark_edge_home() / "checkpoints" / f"{model_id}-{weight_path}"
