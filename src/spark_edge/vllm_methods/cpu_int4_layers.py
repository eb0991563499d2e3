"""The cpu_int4 linear and embedding methods: what each vLLM layer holds and runs.

Checkpoint tensors per quantized layer (prefix P):

    P.weight_packed  uint8 [N, K/2]  row-major nibbles: byte j = code 2j (low) | code 2j+1 (high)
    P.weight_scale   bf16  [N, K/g]
    P.weight_zero    bf16  [N, K/g]  w = (q - 8) * scale + zero

They are created as vLLM parameter classes (N on dim 0, K on dim 1, K packed by 2), so
vLLM's own loaders shard them and stack q/k/v and gate/up into the merged layers.
After loading, each layer builds the tinygemm kernel buffer (in 2048-row chunks) and its
[G, N, 2] scales_and_zeros; with direct_dequant (default) the row-major tensors are then
freed, and the multi-row GEMM and the embedding lookup decode the kernel buffer itself.
On arm64 with KleidiAI (kernels/kleidiai_int4.py) a linear layer builds KleidiAI's packed
weight and its zeros instead, and every GEMM of the layer runs there.

The tied embedding / LM head is quantized once: the head's quant method `tie_weights`
shares the embedding's parameters, and after loading shares its kernel buffers too.

Imported lazily by CpuInt4Config.get_quant_method (i.e. only in the process that builds
the model): it pulls in vLLM's layer modules, which the plugin must not load everywhere.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import Module, Parameter
from vllm.model_executor.layers.linear import LinearMethodBase, register_weight_loader_v2_supported_method
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.parameter import GroupQuantScaleParameter, PackedvLLMParameter

from spark_edge.formats.cpu_int4_config import CpuInt4Settings
from spark_edge.formats.tinygemm_layout import (
    DEFAULT_REPACK_ROWS,
    detect_layout,
    kernel_supports,
    pack_for_kernel,
    scales_and_zeros,
)
from spark_edge.kernels.cpu_int4_op import NAMESPACE, check_activation_dtype, native_linear_available, register_ops
from spark_edge.kernels.kleidiai_int4 import kleidiai_available, kleidiai_fits, kleidiai_linear, pack_weight, zeros_term

register_ops()

CHECKPOINT_PARAMS = ("weight_packed", "weight_scale", "weight_zero")
KERNEL_WEIGHT = "int4_weight"  # the tinygemm buffer, uint8 [N, K/2]
KERNEL_SCALES_ZEROS = "int4_scales_zeros"  # bf16 [G, N, 2]
KLEIDIAI_WEIGHT = "kleidiai_weight"  # KleidiAI's packed weight (uint8 on arm64, the reference's float32 elsewhere)
KLEIDIAI_ZEROS = "kleidiai_zeros_t"  # bf16 [K/g, N]
_READY = "_cpu_int4_ready"
_NATIVE = "_cpu_int4_native"  # the C++ int4_linear serves this layer: decided at load, a constant when traced
_TIED_TO = "_cpu_int4_tied_to"


# -- shared by the linear and the embedding methods (and by cpu_int4_gptq's, once it has rearranged a layer) --


def check_shape(layer: Module, n: int, k: int, group_size: int) -> None:
    where = getattr(layer, "prefix", "") or type(layer).__name__
    if k % group_size:
        raise ValueError(f"cpu_int4: {where}: K={k} is not a multiple of group_size {group_size}")
    if not kernel_supports(n):
        raise ValueError(f"cpu_int4: {where}: N={n} output channels; the CPU int4 kernel needs N % 16 == 0")


def _create_checkpoint_params(layer: Module, n: int, k: int, group_size: int, weight_loader: Any) -> None:
    layer.register_parameter(
        "weight_packed",
        PackedvLLMParameter(
            data=torch.empty(n, k // 2, dtype=torch.uint8),
            input_dim=1,
            output_dim=0,
            packed_dim=1,
            packed_factor=2,
            weight_loader=weight_loader,
        ),
    )
    for name in ("weight_scale", "weight_zero"):
        layer.register_parameter(
            name,
            GroupQuantScaleParameter(
                data=torch.empty(n, k // group_size, dtype=torch.bfloat16),
                input_dim=1,
                output_dim=0,
                weight_loader=weight_loader,
            ),
        )


def build_kernel_buffers(layer: Module, settings: CpuInt4Settings, lookup: bool = False) -> None:
    """Once per layer: KleidiAI's weight (a linear on arm64, where it fits) or the tinygemm buffer +
    scales_and_zeros (also what a table's `lookup` reads); free the row-major copy if unused."""
    if getattr(layer, _READY, False):
        return
    if not lookup and settings.direct_dequant and uses_kleidiai(layer, settings.group_size):
        _build_kleidiai_buffers(layer, settings.group_size)
        return
    if settings.direct_dequant:
        detect_layout()  # decoding the buffer relies on its measured layout (raises if unknown)
    buf = pack_for_kernel(layer.weight_packed.data, DEFAULT_REPACK_ROWS)
    sz = scales_and_zeros(layer.weight_scale.data, layer.weight_zero.data)
    setattr(layer, KERNEL_WEIGHT, Parameter(buf, requires_grad=False))
    setattr(layer, KERNEL_SCALES_ZEROS, Parameter(sz, requires_grad=False))
    if settings.direct_dequant:
        for name in CHECKPOINT_PARAMS:
            delattr(layer, name)
    setattr(layer, _NATIVE, settings.direct_dequant and native_linear_available())
    setattr(layer, _READY, True)


def uses_kleidiai(layer: Module, group_size: int) -> bool:
    """Whether this layer's GEMMs run on KleidiAI: arm64 with it, and a shape its groupwise kernel takes."""
    k = layer.weight_packed.shape[1] * 2
    return kleidiai_available() and kleidiai_fits(k, group_size)


def _build_kleidiai_buffers(layer: Module, group_size: int) -> None:
    weight = pack_weight(layer.weight_packed.data, layer.weight_scale.data, group_size)
    zeros_t = zeros_term(layer.weight_zero.data)
    setattr(layer, KLEIDIAI_WEIGHT, Parameter(weight, requires_grad=False))
    setattr(layer, KLEIDIAI_ZEROS, Parameter(zeros_t, requires_grad=False))
    for name in CHECKPOINT_PARAMS:
        delattr(layer, name)
    setattr(layer, _READY, True)


def _rowmajor(layer: Module) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The row-major tensors a layer kept (direct_dequant false), else Nones."""
    if not hasattr(layer, "weight_packed"):
        return None, None, None
    return layer.weight_packed, layer.weight_scale, layer.weight_zero


def apply_linear(layer: Module, x: torch.Tensor, group_size: int, bias: torch.Tensor | None) -> torch.Tensor:
    check_activation_dtype(x)
    x2 = x.reshape(-1, x.shape[-1])
    ops = getattr(torch.ops, NAMESPACE)
    if hasattr(layer, KLEIDIAI_WEIGHT):  # decided at load, as _NATIVE: constants when traced
        zeros_t = getattr(layer, KLEIDIAI_ZEROS)
        out = kleidiai_linear(x2, getattr(layer, KLEIDIAI_WEIGHT), zeros_t, group_size, zeros_t.shape[1])
    elif getattr(layer, _NATIVE):  # the C++ op: no Python in the compiled graph's call
        out = ops.int4_linear(x2, getattr(layer, KERNEL_WEIGHT), getattr(layer, KERNEL_SCALES_ZEROS), group_size)
    else:
        weight, scales_zeros = getattr(layer, KERNEL_WEIGHT), getattr(layer, KERNEL_SCALES_ZEROS)
        out = ops.cpu_int4_linear(x2, weight, scales_zeros, group_size, *_rowmajor(layer))
    out = out.reshape(*x.shape[:-1], out.shape[-1])
    return out if bias is None else out + bias


# -- linear layers -------------------------------------------------------------------------


class _CpuInt4Weights:
    """The checkpoint's parameters of a cpu_int4 layer, for linears and the vocabulary alike (for the table,
    VocabParallelEmbedding's loader narrows the vocab rows and zero-fills the padding)."""

    def __init__(self, settings: CpuInt4Settings) -> None:
        self.settings = settings

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
        n, k, g = sum(output_partition_sizes), input_size_per_partition, self.settings.group_size
        check_shape(layer, n, k, g)
        _create_checkpoint_params(layer, n, k, g, extra_weight_attrs["weight_loader"])


@register_weight_loader_v2_supported_method  # so linear layers load our vLLM parameter classes
class CpuInt4LinearMethod(_CpuInt4Weights, LinearMethodBase):
    def process_weights_after_loading(self, layer: Module) -> None:
        build_kernel_buffers(layer, self.settings)

    def apply(self, layer: Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return apply_linear(layer, x, self.settings.group_size, bias)


# -- the token embedding and the LM head -----------------------------------------------------


class CpuInt4EmbeddingMethod(_CpuInt4Weights, QuantizeMethodBase):
    """Lookup (`embedding`) for the token table, GEMM (`apply`) for the LM head."""

    def tie_weights(self, layer: Module, embed_tokens: Module) -> Module:
        """Make the LM head read the embedding's parameters (one quantized table for both)."""
        if not isinstance(getattr(embed_tokens, "quant_method", None), CpuInt4EmbeddingMethod):
            raise ValueError("cpu_int4: a quantized LM head can only be tied to a quantized embedding")
        for name in CHECKPOINT_PARAMS:
            setattr(layer, name, getattr(embed_tokens, name))
        # not a submodule: that would give the table a second name in the module tree
        object.__setattr__(layer, _TIED_TO, embed_tokens)
        return layer

    def process_weights_after_loading(self, layer: Module) -> None:
        source = getattr(layer, _TIED_TO, None)
        if source is None:
            build_kernel_buffers(layer, self.settings, lookup=True)
            return
        # build once (in whichever order vLLM visits the two), then share every tensor
        source.quant_method.process_weights_after_loading(source)
        for name in (KERNEL_WEIGHT, KERNEL_SCALES_ZEROS, *CHECKPOINT_PARAMS):
            if hasattr(source, name):
                setattr(layer, name, getattr(source, name))
            elif name in layer._parameters:
                delattr(layer, name)  # freed on the source; drop our reference too
        setattr(layer, _NATIVE, getattr(source, _NATIVE))
        setattr(layer, _READY, True)

    def embedding(self, layer: Module, input_: torch.Tensor) -> torch.Tensor:
        weight, sz, group = getattr(layer, KERNEL_WEIGHT), getattr(layer, KERNEL_SCALES_ZEROS), self.settings.group_size
        ops = getattr(torch.ops, NAMESPACE)
        if getattr(layer, _NATIVE):  # the C++ lookup: no Python in the compiled graph's call
            rows = ops.int4_embedding(input_.reshape(-1), weight, sz, group)
        else:
            rows = ops.cpu_int4_embedding(input_.reshape(-1), weight, sz, group, *_rowmajor(layer))
        return rows.reshape(*input_.shape, weight.shape[1] * 2)

    def apply(self, layer: Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return apply_linear(layer, x, self.settings.group_size, bias)
