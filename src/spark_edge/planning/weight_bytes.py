"""Resident weight bytes of a model on each weight path, from its shape alone.

The same arithmetic as the checkpoint formats (each path's, in spark_edge.registry), so the plan can be
made before a checkpoint is built; a test holds it to the sizes of real builds.
"""

from __future__ import annotations

from spark_edge.planning.model_shape import ModelShape
from spark_edge.registry import BF16, weight_path

__all__ = ["BF16", "weight_bytes"]


def weight_bytes(shape: ModelShape, path: str, group: int) -> int:
    return weight_path(path).stored_bytes(shape, group)
