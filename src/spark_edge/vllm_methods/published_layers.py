"""The linear methods of published 4-bit checkpoints: each layer loads the checkpoint's own tensors, then is
rearranged into cpu_int4's (codes, scale, zero) and served as a cpu_int4 layer (with act-order, its
activations permuted first).

Imported lazily by the configs' get_quant_method (it pulls in vLLM's layer modules).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import Module, Parameter
from vllm.model_executor.layers.linear import LinearMethodBase, register_weight_loader_v2_supported_method
from vllm.model_executor.parameter import (
    BasevLLMParameter,
    GroupQuantScaleParameter,
    PackedvLLMParameter,
    RowvLLMParameter,
)

from spark_edge.formats.gptq_layout import PACK
from spark_edge.formats.rearrange_4bit import CpuInt4Parts
from spark_edge.vllm_methods import published_awq, published_ct, published_gptq
from spark_edge.vllm_methods.cpu_int4_layers import apply_linear, build_kernel_buffers, check_shape

_ORDER = "cpu_int4_input_order"  # int64 [K]: act-order's column order, a buffer of the layer


class _PublishedInt4LinearMethod(LinearMethodBase):
    """create_weights registers the checkpoint's tensors (`loaded`); rearrange turns them into cpu_int4's."""

    loaded: tuple[str, ...]

    def __init__(self, config: Any) -> None:
        self.config = config

    def rearrange(self, layer: Module, where: str) -> CpuInt4Parts:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: Module) -> None:
        parts = self.rearrange(layer, getattr(layer, "prefix", "") or type(layer).__name__)
        for name in self.loaded:
            if hasattr(layer, name):
                delattr(layer, name)
        layer.weight_packed = Parameter(parts.packed, requires_grad=False)
        layer.weight_scale = Parameter(parts.scale, requires_grad=False)
        layer.weight_zero = Parameter(parts.zero, requires_grad=False)
        layer.register_buffer(_ORDER, parts.order, persistent=False)
        build_kernel_buffers(layer, self.config.settings)

    def apply(self, layer: Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        order = getattr(layer, _ORDER)
        if order is not None:  # act-order: the columns in the order the codes were sorted to
            x = x.index_select(-1, order)
        return apply_linear(layer, x, self.config.fmt.group_size, bias)


@register_weight_loader_v2_supported_method
class GptqLinearMethod(_PublishedInt4LinearMethod):
    loaded = published_gptq.SUFFIXES

    def create_weights(
        self,
        layer: Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        n, k, g = sum(output_partition_sizes), input_size_per_partition, self.config.fmt.group_size
        check_shape(layer, n, k, g)
        loader = extra_weight_attrs["weight_loader"]
        qweight = torch.empty(k // PACK, n, dtype=torch.int32)
        qzeros = torch.empty(k // g, n // PACK, dtype=torch.int32)
        common = {"input_dim": 0, "output_dim": 1, "weight_loader": loader}
        layer.register_parameter(
            "qweight", PackedvLLMParameter(data=qweight, packed_dim=0, packed_factor=PACK, **common)
        )
        layer.register_parameter("qzeros", PackedvLLMParameter(data=qzeros, packed_dim=1, packed_factor=PACK, **common))
        # float32 holds the checkpoint's fp16 (or bf16) scales exactly
        layer.register_parameter("scales", GroupQuantScaleParameter(data=torch.empty(k // g, n), **common))
        # the serve-time check refused a checkpoint without g_idx
        g_idx = torch.empty(k, dtype=torch.int32)
        layer.register_parameter("g_idx", RowvLLMParameter(data=g_idx, input_dim=0, weight_loader=loader))

    def rearrange(self, layer: Module, where: str) -> CpuInt4Parts:
        return published_gptq.to_cpu_int4(
            layer.qweight.data, layer.qzeros.data, layer.scales.data, layer.g_idx.data, self.config.fmt, where
        )


@register_weight_loader_v2_supported_method
class AwqLinearMethod(_PublishedInt4LinearMethod):
    loaded = published_awq.SUFFIXES

    def create_weights(
        self,
        layer: Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        n, k, g = sum(output_partition_sizes), input_size_per_partition, self.config.fmt.group_size
        check_shape(layer, n, k, g)
        common = {"input_dim": 0, "output_dim": 1, "weight_loader": extra_weight_attrs["weight_loader"]}
        packed = {"packed_dim": 1, "packed_factor": PACK, **common}  # both along N, in AWQ's nibble order
        layer.register_parameter(
            "qweight", PackedvLLMParameter(data=torch.empty(k, n // PACK, dtype=torch.int32), **packed)
        )
        layer.register_parameter(
            "qzeros", PackedvLLMParameter(data=torch.empty(k // g, n // PACK, dtype=torch.int32), **packed)
        )
        layer.register_parameter("scales", GroupQuantScaleParameter(data=torch.empty(k // g, n), **common))

    def rearrange(self, layer: Module, where: str) -> CpuInt4Parts:
        return published_awq.to_cpu_int4(
            layer.qweight.data, layer.qzeros.data, layer.scales.data, self.config.fmt, where
        )


@register_weight_loader_v2_supported_method
class CompressedTensorsLinearMethod(_PublishedInt4LinearMethod):
    loaded = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")

    def create_weights(
        self,
        layer: Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        fmt = self.config.fmt
        n, k, g = sum(output_partition_sizes), input_size_per_partition, fmt.group_size
        check_shape(layer, n, k, g)
        loader = extra_weight_attrs["weight_loader"]
        common = {"input_dim": 1, "output_dim": 0, "weight_loader": loader}
        packed = torch.empty(n, k // PACK, dtype=torch.int32)
        layer.register_parameter(
            "weight_packed", PackedvLLMParameter(data=packed, packed_dim=1, packed_factor=PACK, **common)
        )
        layer.register_parameter("weight_scale", GroupQuantScaleParameter(data=torch.empty(n, k // g), **common))
        shape = torch.empty(2, dtype=torch.int64)
        layer.register_parameter("weight_shape", BasevLLMParameter(data=shape, weight_loader=loader))
        if not fmt.symmetric:
            zeros = torch.empty(n // PACK, k // g, dtype=torch.int32)
            layer.register_parameter(
                "weight_zero_point", PackedvLLMParameter(data=zeros, packed_dim=0, packed_factor=PACK, **common)
            )
        if fmt.act_order:
            g_idx = torch.empty(k, dtype=torch.int32)
            layer.register_parameter("weight_g_idx", RowvLLMParameter(data=g_idx, input_dim=0, weight_loader=loader))

    def rearrange(self, layer: Module, where: str) -> CpuInt4Parts:
        zeros = layer.weight_zero_point.data if hasattr(layer, "weight_zero_point") else None
        g_idx = layer.weight_g_idx.data if hasattr(layer, "weight_g_idx") else None
        return published_ct.to_cpu_int4(
            layer.weight_packed.data, layer.weight_scale.data, zeros, g_idx, self.config.fmt, where
        )


LINEAR_METHODS: dict[str, type[_PublishedInt4LinearMethod]] = {
    published_gptq.METHOD: GptqLinearMethod,
    published_awq.METHOD: AwqLinearMethod,
    published_ct.METHOD: CompressedTensorsLinearMethod,
}
