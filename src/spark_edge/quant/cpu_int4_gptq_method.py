"""vLLM quantization method "cpu_int4_gptq": a published 4-bit GPTQ checkpoint on the cpu_int4 kernels.

Registered out of tree like cpu_int4 (the plugin imports this module in every vLLM process). vLLM picks it
only when asked (`--quantization cpu_int4_gptq`, which `spark-edge serve` passes for a published GPTQ folder):
spark-edge's own w4a8 builds are GPTQ checkpoints too, meant for vLLM's AMX kernel, and stay on vLLM's
method. Layers load the checkpoint's tensors with vLLM's parameter classes (so merged q/k/v and gate/up
stack as in vLLM's GPTQ method), then each is rearranged into cpu_int4's form
(spark_edge.quant.published_gptq) and served exactly as a w4a16 build's layer (cpu_int4_gptq_layers,
imported on the first get_quant_method call: this module stays cheap for the API server).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import Module
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase

from spark_edge.quant.cpu_int4_config import CpuInt4Settings
from spark_edge.quant.published_gptq import METHOD, GptqFormat


@register_quantization_config(METHOD)
class CpuInt4GptqConfig(QuantizationConfig):
    """A GPTQ checkpoint's quantization_config, served on the cpu_int4 kernels."""

    def __init__(self, fmt: GptqFormat) -> None:
        super().__init__()
        self.fmt = fmt
        # the head and the table stay as the checkpoint has them (GPTQ leaves them unquantized)
        self.settings = CpuInt4Settings(group_size=fmt.group_size, quantize_embedding=False)

    def __repr__(self) -> str:
        return f"CpuInt4GptqConfig({self.fmt})"

    def get_name(self) -> str:
        return METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # CPU only

    @staticmethod
    def get_config_filenames() -> list[str]:
        return ["quantize_config.json"]  # what older AutoGPTQ exports write beside config.json

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CpuInt4GptqConfig:
        return cls(GptqFormat.from_hf(config))

    @staticmethod
    def get_checkpoint_weight_mapper() -> Any:
        """Keep g_idx: vLLM's default mapper drops it (its kernels ignore act-order); here it orders the GEMM."""
        from vllm.model_executor.models.utils import WeightsMapper

        return WeightsMapper()

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: dict, user_quant: str | None, **_: Any) -> str | None:
        # only when asked for: a "gptq" config keeps vLLM's own method otherwise
        return METHOD if user_quant == METHOD and hf_quant_cfg.get("quant_method") == "gptq" else None

    def get_quant_method(self, layer: Module, prefix: str) -> QuantizeMethodBase | None:
        from vllm.model_executor.layers.linear import LinearBase

        from spark_edge.quant.cpu_int4_gptq_layers import CpuInt4GptqLinearMethod

        return CpuInt4GptqLinearMethod(self) if isinstance(layer, LinearBase) else None
