"""vLLM quantization methods for published 4-bit checkpoints, served on the cpu_int4 kernels:
"cpu_int4_gptq" (GPTQ exports), "cpu_int4_awq" (AutoAWQ GEMM exports) and "cpu_int4_ct" (compressed-tensors
pack-quantized W4A16).

Registered out of tree like cpu_int4 (the plugin imports this module in every vLLM process). vLLM picks one
only when asked (`--quantization NAME`, which `spark-edge serve` passes for such a folder): spark-edge's own
w4a8 builds are GPTQ checkpoints too, meant for vLLM's AMX kernel, and stay on vLLM's method. Layers load the
checkpoint's tensors with vLLM's parameter classes (so merged q/k/v and gate/up stack as in vLLM's own
methods), then each is rearranged into cpu_int4's form (spark_edge.formats.rearrange_4bit) and served exactly as
a w4a16 build's layer (published_layers, imported on the first get_quant_method call: this module stays cheap
for the API server).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import Module
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase

from spark_edge.formats.cpu_int4_config import CpuInt4Settings
from spark_edge.vllm_methods import published_awq, published_ct, published_gptq


class _PublishedInt4Config(QuantizationConfig):
    method: str  # our method's name
    source_method: str  # the checkpoint's quant_method

    def __init__(self, fmt: Any) -> None:
        super().__init__()
        self.fmt = fmt
        # the head and the table stay as the checkpoint has them (these exports leave them unquantized)
        self.settings = CpuInt4Settings(group_size=fmt.group_size, quantize_embedding=False)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.fmt})"

    def get_name(self) -> str:
        return self.method

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # CPU only

    @staticmethod
    def get_checkpoint_weight_mapper() -> Any:
        """Keep g_idx: vLLM's default mapper drops it (its kernels ignore act-order); here it orders the GEMM."""
        from vllm.model_executor.models.utils import WeightsMapper

        return WeightsMapper()

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: dict, user_quant: str | None, **_: Any) -> str | None:
        # only when asked for: the checkpoint keeps vLLM's own method otherwise
        return (
            cls.method if user_quant == cls.method and hf_quant_cfg.get("quant_method") == cls.source_method else None
        )

    def is_quantized(self, prefix: str) -> bool:
        return True

    def get_quant_method(self, layer: Module, prefix: str) -> QuantizeMethodBase | None:
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

        from spark_edge.vllm_methods.published_layers import LINEAR_METHODS

        if not isinstance(layer, LinearBase):
            return None
        return LINEAR_METHODS[self.method](self) if self.is_quantized(prefix) else UnquantizedLinearMethod()


@register_quantization_config(published_gptq.METHOD)
class CpuInt4GptqConfig(_PublishedInt4Config):
    """A GPTQ checkpoint's quantization_config."""

    method, source_method = published_gptq.METHOD, published_gptq.SOURCE_METHOD

    @staticmethod
    def get_config_filenames() -> list[str]:
        return ["quantize_config.json"]  # what older AutoGPTQ exports write beside config.json

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CpuInt4GptqConfig:
        return cls(published_gptq.GptqFormat.from_hf(config))


@register_quantization_config(published_awq.METHOD)
class CpuInt4AwqConfig(_PublishedInt4Config):
    """An AutoAWQ (GEMM) checkpoint's quantization_config."""

    method, source_method = published_awq.METHOD, published_awq.SOURCE_METHOD

    @staticmethod
    def get_config_filenames() -> list[str]:
        return ["quant_config.json", "quantize_config.json"]  # what older AutoAWQ exports write beside config.json

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CpuInt4AwqConfig:
        return cls(published_awq.AwqFormat.from_hf(config))

    def is_quantized(self, prefix: str) -> bool:
        return not any(module in prefix for module in self.fmt.not_converted)  # as vLLM's AWQ matches them


@register_quantization_config(published_ct.METHOD)
class CpuInt4CtConfig(_PublishedInt4Config):
    """A compressed-tensors W4A16 checkpoint's quantization_config (parsed by the compressed-tensors library)."""

    method, source_method = published_ct.METHOD, published_ct.SOURCE_METHOD

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CpuInt4CtConfig:
        return cls(published_ct.CtFormat.from_hf(config))

    def is_quantized(self, prefix: str) -> bool:
        # vLLM's own matcher: exact names, "re:" patterns, and fused layers (qkv_proj) through their parts
        from vllm.model_executor.layers.quantization.compressed_tensors.utils import should_ignore_layer

        return not should_ignore_layer(prefix, list(self.fmt.ignore), self.packed_modules_mapping)
