"""How a config says its weights are random (`spark-edge synth`): torch-free, so the probe can ask."""

from __future__ import annotations

from typing import Any

SYNTHETIC_KEY = "spark_edge_synthetic"


def synthetic_origin(config: dict[str, Any]) -> str | None:
    """ "random weights shaped like NAME (seed S)" for a synthetic checkpoint's config, else None."""
    marker = config.get(SYNTHETIC_KEY)
    if not marker:
        return None
    return f"random weights shaped like {marker.get('like', '?')} (seed {marker.get('seed', '?')})"
