"""cpu_int4's 8-bit vocabulary table (embedding_bits 8): the token embedding and the (tied) LM head.

Checkpoint tensors (spark_edge.formats.int8_rows), prefix P:

    P.weight_int8   int8    [N, K]  w = q * scale
    P.weight_scale  float32 [N]

The head's GEMM is one of vLLM's own int8 kernels, the hidden state quantized per token (as its w8a8
methods do), chosen at load:

- `packed`: on CPUs with AVX512-VNNI, vLLM's `int8_scaled_mm_with_quant` (SGLang's CPU GEMM in vLLM's AVX-512
  build: AMX tiles where the process may use them, VNNI micro-kernels elsewhere; vLLM itself calls it only
  with AMX). Its packed weight (blocks of 32 rows, K in groups of 4, a compensation word a row) replaces the
  codes, and the lookup gathers its rows from that layout, checked against the codes once per process: one
  copy of the table, which the mapped weights hold.
- `onednn`: elsewhere on CPUs with integer dot products (AVX-VNNI without AVX-512: vLLM's `_C_AVX2` has no
  packed GEMM), vLLM's oneDNN int8 matmul. It keeps its own packed copy of the codes beside the rows the lookup
  reads (the plan counts it: INT8_HEAD_COPIES).
- `native`: on CPUs without them (AVX2 before AVX-VNNI: Zen 3 and older, Haswell to Comet Lake; Skylake-SP),
  where oneDNN's int8 matmul saturates and crawls (cpu_features.INT8_DOT_FEATURES), spark-edge's own
  `int8_rows_gemm` (kernels/native/int8_rows_gemm.cpp: vpmaddubsw on the rows themselves, activations int8 per
  32-K block as the int4 decode kernel's). No copy of the table either.
- `int8pack`: where neither serves (no C++ library, no AVX2, or `int8_rows_gemm` disabled, or vLLM's wheel has
  no oneDNN int8 matmul), PyTorch's `_weight_int8pack_mm` (bf16 activations).

On the default model (Intel Xeon AMX, one process), per-token int8 of the head's input cost x1.009
perplexity over bf16 activations, and its GEMM took 0.73 ms (oneDNN) and 0.78 ms (AMX) cache-hot against
1.70 ms for `_weight_int8pack_mm` and 0.51 ms for the 4-bit table; in a decode step, with the table read
from memory, 1.56 ms. On an AMD EPYC Zen 4 (AVX512-VNNI, no AMX; 2 threads, tables read from memory) the
packed GEMM took 0.96 ms a row against oneDNN's 1.41 on the 49152 x 576 table, 0.85 against 1.27 at 4 rows,
and on the 1.7B shape's 49152 x 2048 2.29 against 4.18 (1 row) and 2.46 against 3.75 (4 rows), the same
results (per-token int8 both). On an AMD EPYC Zen 3 (AVX2, no VNNI; the 49152 x 576 table) `native` took
2.4-2.7 ms a row against 3.8-3.9 for `_weight_int8pack_mm` (and 22.7 for oneDNN's), 3.0 against 4.4-5.0 at 4
rows, 7.0-7.9 against 17.5-18.1 at 16.

When the head is tied, it shares the embedding's tensors and kernel (one table, as the 4-bit method).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.nn import Module
from vllm import _custom_ops as ops
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.parameter import ChannelQuantScaleParameter, ModelWeightParameter

from spark_edge.environment import kernel_enabled
from spark_edge.kernels.native_int4 import load_native_ops
from spark_edge.probe.cpu_features import host_has_int8_dot, host_runs_packed_int8_gemm

CODES, SCALE = "weight_int8", "weight_scale"
KERNELS = ("packed", "onednn", "native", "int8pack")
_KERNEL = "_int8_table_kernel"
_GEMM = "_int8_table_gemm"  # the oneDNN handler (onednn), else None
_TIED_TO = "_int8_table_tied_to"
_PRIMITIVE_CACHE = 32  # oneDNN primitives kept per handler, as vLLM's w8a8 method keeps
_PACKED_BLOCK = 32  # rows per block of vLLM's packed int8 weight
_PACKED_K = 4  # K elements a row keeps together in it


def onednn_int8_available() -> bool:
    return hasattr(torch.ops._C, "create_onednn_scaled_mm_handler")


def packed_int8_available(n: int, k: int) -> bool:
    """vLLM's packed int8 GEMM serves this [N, K] table here: its op is built (vLLM's AVX-512 `_C`), the CPU
    runs it (AVX512-VNNI), K in its groups, whole blocks of rows for the lookup, its packed layout the one the
    lookup reads, and it is not disabled."""
    return (
        hasattr(torch.ops._C, "int8_scaled_mm_with_quant")
        and kernel_enabled("int8_packed_gemm")
        and host_runs_packed_int8_gemm()
        and k % 32 == 0
        and n % _PACKED_BLOCK == 0
        and _packed_layout_is_known()
    )


def native_int8_available(k: int) -> bool:
    """spark-edge's int8_rows_gemm in its vector form (AVX2) for K, not disabled."""
    return (
        k % 32 == 0
        and kernel_enabled("int8_rows_gemm")
        and load_native_ops()
        and bool(torch.ops.spark_edge.int8_rows_vectorized())
    )


def choose_kernel(n: int, k: int) -> str:
    if packed_int8_available(n, k):
        return "packed"
    if onednn_int8_available() and host_has_int8_dot():
        return "onednn"
    return "native" if native_int8_available(k) else "int8pack"


def _packed_rows(packed: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Rows `ids` of the table from vLLM's packed layout: [N/32] blocks of (K/4, 32, 4) codes, then 32 int32."""
    blocks = packed.view(-1, _PACKED_BLOCK * (k + 4))[:, : _PACKED_BLOCK * k]
    blocks = blocks.view(-1, k // _PACKED_K, _PACKED_BLOCK, _PACKED_K)
    return blocks[ids // _PACKED_BLOCK, :, ids % _PACKED_BLOCK, :].reshape(*ids.shape, k)


@functools.cache
def _packed_layout_is_known() -> bool:
    """vLLM packs its int8 weight as _packed_rows reads it (it documents no layout: checked on a probe)."""
    seeded = torch.Generator().manual_seed(0)
    codes = torch.randint(-127, 128, (2 * _PACKED_BLOCK, 64), dtype=torch.int8, generator=seeded)
    packed = torch.ops._C.convert_weight_packed(codes)
    if packed.dtype != torch.int8 or packed.numel() != codes.shape[0] * (codes.shape[1] + 4):
        return False
    return torch.equal(_packed_rows(packed, torch.arange(codes.shape[0]), codes.shape[1]), codes)


def onednn_gemm(codes: torch.Tensor, scale: torch.Tensor) -> ops.CPUDNNLGEMMHandler:
    """oneDNN's int8 GEMM over [N, K] codes with per-row scales. It packs its own copy of the codes but reads
    the scales from the tensor it was given at every call: that tensor is kept with the handler, a copy
    apart from the parameter, whose storage the mapped weights replace after load."""
    scales = scale.float().clone()
    handler = ops.create_onednn_scaled_mm(codes.t(), scales, torch.bfloat16, True, False, _PRIMITIVE_CACHE)
    handler.scales = scales
    return handler


def int8_head(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, kernel: str, gemm: Any) -> torch.Tensor:
    """[M, K] activations times the [N, K] table (codes in the kernel's layout): [M, N] in x's dtype."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    n = scale.shape[0]
    if kernel == "packed":
        out = torch.ops._C.int8_scaled_mm_with_quant(x2, codes, scale, None, x2.dtype, True)
    elif kernel == "onednn":
        xq, xs, _ = ops.onednn_scaled_int8_quant(x2, None, None, True)
        out = torch.empty(x2.shape[0], n, dtype=x2.dtype)
        ops.onednn_scaled_mm(gemm, xq, out, xs, None, None, None)
    elif kernel == "native":
        out = torch.ops.spark_edge.int8_rows_gemm(x2.to(torch.bfloat16), codes, scale).to(x2.dtype)
    else:
        out = torch._weight_int8pack_mm(x2, codes, scale.to(x2.dtype))
    return out.reshape(*x.shape[:-1], n)


def int8_lookup(ids: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, kernel: str, k: int) -> torch.Tensor:
    rows = _packed_rows(codes, ids, k) if kernel == "packed" else codes[ids]
    return (rows.float() * scale[ids].unsqueeze(-1)).to(torch.bfloat16)


class CpuInt8TableMethod(QuantizeMethodBase):
    """Lookup (`embedding`) for the token table, GEMM (`apply`) for the LM head."""

    def __init__(self, kernel: str | None = None) -> None:
        if kernel is not None and kernel not in KERNELS:
            raise ValueError(f"cpu_int4: unknown 8-bit table kernel {kernel!r} (known: {KERNELS})")
        self.kernel = kernel  # None: chosen at load for the table's shape

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
        n, k, loader = sum(output_partition_sizes), input_size_per_partition, extra_weight_attrs["weight_loader"]
        # VocabParallelEmbedding's loader narrows the vocab rows (dim 0) and zero-fills the padding
        codes = torch.empty(n, k, dtype=torch.int8)
        layer.register_parameter(
            CODES, ModelWeightParameter(data=codes, input_dim=1, output_dim=0, weight_loader=loader)
        )
        scale = torch.empty(n, dtype=torch.float32)
        layer.register_parameter(SCALE, ChannelQuantScaleParameter(data=scale, output_dim=0, weight_loader=loader))
        layer.int8_table_k = k

    def tie_weights(self, layer: Module, embed_tokens: Module) -> Module:
        if not isinstance(getattr(embed_tokens, "quant_method", None), CpuInt8TableMethod):
            raise ValueError("cpu_int4: an 8-bit LM head can only be tied to an 8-bit embedding")
        for name in (CODES, SCALE):
            setattr(layer, name, getattr(embed_tokens, name))
        object.__setattr__(layer, _TIED_TO, embed_tokens)  # not a submodule: one name for the table
        return layer

    def process_weights_after_loading(self, layer: Module) -> None:
        source = getattr(layer, _TIED_TO, None)
        if source is not None:
            source.quant_method.process_weights_after_loading(source)
            for name in (_KERNEL, _GEMM):
                object.__setattr__(layer, name, getattr(source, name))
            return
        if hasattr(layer, _KERNEL):
            return
        codes, scale = getattr(layer, CODES), getattr(layer, SCALE)
        kernel = self.kernel or choose_kernel(*codes.shape)
        gemm = None
        if kernel == "packed":
            codes.data = torch.ops._C.convert_weight_packed(codes.data)  # the one copy: the lookup reads it too
        elif kernel == "onednn":
            gemm = onednn_gemm(codes, scale)
        object.__setattr__(layer, _KERNEL, kernel)
        object.__setattr__(layer, _GEMM, gemm)

    def embedding(self, layer: Module, input_: torch.Tensor) -> torch.Tensor:
        kernel = getattr(layer, _KERNEL)
        return int8_lookup(input_, getattr(layer, CODES), getattr(layer, SCALE), kernel, layer.int8_table_k)

    def apply(self, layer: Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        kernel, gemm = getattr(layer, _KERNEL), getattr(layer, _GEMM)
        out = int8_head(x, getattr(layer, CODES), getattr(layer, SCALE), kernel, gemm)
        return out if bias is None else out + bias
