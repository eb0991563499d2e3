"""What a model that transformers does not build declares about its checkpoint's tensors, so that the generic
checkpoint code (spark_edge.checkpoints.architecture, the weight-path writers) names no model of its own.

Plain Python: the writers and the plan read it without torch or vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DeclaredLayout:
    architecture: str
    model_type: str
    embedding: str  # the token table's tensor
    head: str  # the head's tensor (read from the table when tied)
    linear_suffixes: tuple[str, ...]  # the decoder blocks' Linear weights: what the 4-bit paths quantize
    full_precision_suffixes: tuple[str, ...] = ()  # plain parameters kept in bf16 on every path
    fused_qkv: str | None = None  # a fused q|k|v projection's name part, if the checkpoint has one

    def matches(self, config: dict[str, Any]) -> bool:
        return config.get("model_type") == self.model_type or self.architecture in (config.get("architectures") or [])
