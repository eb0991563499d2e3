"""vLLM quantization method "cpu_int4": 4-bit weights, bf16 activations (W4A16) on CPU.

Registered out of tree: importing this module registers the config class with vLLM
(spark_edge.plugin imports it in every vLLM process); vLLM itself is not modified.
This module stays cheap to import (no vLLM layer modules): the per-layer methods live
in cpu_int4_layers and are imported on the first get_quant_method call, which only
happens in the process that builds the model.  See cpu_int4_layers for the tensors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import Module
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase

from spark_edge.formats.cpu_int4_config import QUANT_METHOD, CpuInt4Settings


@register_quantization_config(QUANT_METHOD)
class CpuInt4Config(QuantizationConfig):
    """Group-wise asymmetric 4-bit weights served by PyTorch's CPU int4 kernel."""

    def __init__(self, settings: CpuInt4Settings | None = None) -> None:
        super().__init__()
        self.settings = settings or CpuInt4Settings()

    def __repr__(self) -> str:
        s = self.settings
        return (
            f"CpuInt4Config(group_size={s.group_size}, quantize_embedding={s.quantize_embedding}, "
            f"embedding_bits={s.embedding_bits}, direct_dequant={s.direct_dequant})"
        )

    def get_name(self) -> str:
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # CPU only; vLLM reports no device capability there

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # the settings live in config.json's quantization_config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CpuInt4Config:
        return cls(CpuInt4Settings.from_hf(config))

    def get_quant_method(self, layer: Module, prefix: str) -> QuantizeMethodBase | None:
        from vllm.model_executor.layers.linear import LinearBase
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        from spark_edge.vllm_methods.cpu_int4_layers import CpuInt4EmbeddingMethod, CpuInt4LinearMethod

        # VocabParallelEmbedding covers ParallelLMHead, its subclass
        if isinstance(layer, VocabParallelEmbedding):
            if not self.settings.quantize_embedding:
                return None
            if self.settings.embedding_bits == 8:
                from spark_edge.vllm_methods.cpu_int8_table import CpuInt8TableMethod

                return CpuInt8TableMethod()
            return CpuInt4EmbeddingMethod(self.settings)
        if isinstance(layer, LinearBase):
            return CpuInt4LinearMethod(self.settings)
        return None
