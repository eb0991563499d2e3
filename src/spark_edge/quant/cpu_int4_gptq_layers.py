"""The cpu_int4_gptq linear method: a published GPTQ layer loaded as it is, then served as a cpu_int4 layer.

Imported lazily by CpuInt4GptqConfig.get_quant_method (it pulls in vLLM's layer modules).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import Module, Parameter
from vllm.model_executor.layers.linear import LinearMethodBase, register_weight_loader_v2_supported_method
from vllm.model_executor.parameter import GroupQuantScaleParameter, PackedvLLMParameter, RowvLLMParameter

from spark_edge.quant.cpu_int4_gptq_method import CpuInt4GptqConfig
from spark_edge.quant.cpu_int4_layers import apply_linear, build_kernel_buffers, check_shape
from spark_edge.quant.published_gptq import PACK, to_cpu_int4

_ORDER = "cpu_int4_input_order"  # int64 [K]: act-order's column order, a buffer of the layer


@register_weight_loader_v2_supported_method
class CpuInt4GptqLinearMethod(LinearMethodBase):
    def __init__(self, config: CpuInt4GptqConfig) -> None:
        self.config = config

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
        layer.register_parameter(
            "qweight",
            PackedvLLMParameter(
                data=torch.empty(k // PACK, n, dtype=torch.int32),
                input_dim=0,
                output_dim=1,
                packed_dim=0,
                packed_factor=PACK,
                weight_loader=loader,
            ),
        )
        layer.register_parameter(
            "qzeros",
            PackedvLLMParameter(
                data=torch.empty(k // g, n // PACK, dtype=torch.int32),
                input_dim=0,
                output_dim=1,
                packed_dim=1,
                packed_factor=PACK,
                weight_loader=loader,
            ),
        )
        layer.register_parameter(
            "scales",  # float32 holds the checkpoint's fp16 (or bf16) scales exactly
            GroupQuantScaleParameter(
                data=torch.empty(k // g, n, dtype=torch.float32), input_dim=0, output_dim=1, weight_loader=loader
            ),
        )
        layer.register_parameter(
            "g_idx",  # the serve-time check refused a checkpoint without it
            RowvLLMParameter(data=torch.empty(k, dtype=torch.int32), input_dim=0, weight_loader=loader),
        )

    def process_weights_after_loading(self, layer: Module) -> None:
        where = getattr(layer, "prefix", "") or type(layer).__name__
        parts = to_cpu_int4(
            layer.qweight.data, layer.qzeros.data, layer.scales.data, layer.g_idx.data, self.config.fmt, where
        )
        for name in ("qweight", "qzeros", "scales", "g_idx"):
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
