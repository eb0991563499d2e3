"""The cpu_int4 kernels as opaque custom ops: torch.ops.spark_edge.cpu_int4_{linear,embedding}.

Why opaque: the GEMM picks its kernel by the number of activation rows.  Written inline,
that branch would become a dynamo guard on the batch size inside vLLM's single traced
graph; inside a custom op the compiled graph sees one call with a fake [M, N] result,
and the branch runs eagerly at call time.  The embedding lookup is opaque for the same
reason (its gather is data-dependent and gains nothing from inductor).

Kernel choice, by activation rows M:
- M <= ROW_LOOP_MAX_ROWS (8; decode, batched decode of a few streams): PyTorch's tinygemm
  `_weight_int4pack_mm_for_cpu`, one row per call.  It reads 4.x bits per weight; decode is
  bandwidth bound, so this is the point of the path.  One row per call, never several: on
  AMX hosts, tinygemm on a multi-row batch followed by vLLM's CPU attention in the same
  forward has been seen to die with SIGILL in the attention kernel (AMX tile state); single
  rows never trip it.  Tinygemm's cost is linear in M anyway, and up to 8 rows the loop
  beats dequantizing (one core: the 49152-row head at M=4 6.8 ms vs 66 ms, gate_up 0.5 vs 1.3).
- larger M (prefill): dequantize the weight to bf16 once per call and use oneDNN's GEMM (the
  dequantization in one C pass, native_dequant.py, where a compiler is present).

Only bf16 activations are accepted: the fp32 entry of the tinygemm op has no vectorized
path (tens of times slower), so a float32 model must fail clearly, not crawl.

The row-major tensors (rm_*) are passed only when a layer keeps its checkpoint copy
(quantization_config direct_dequant: false); otherwise the multi-row path and the lookup
decode the kernel buffer itself.  Passing None vs tensors changes the traced graph,
which is why that switch is a config field (hashed into vLLM's compile-cache key).
"""

from typing import Optional

import torch
from torch.library import Library

from spark_edge.quant.int4_asym import dequantize, unpack_nibbles
from spark_edge.quant.native_dequant import dequantize_kernel_weight_t
from spark_edge.quant.tinygemm_layout import dequantize_kernel_weight, gather_kernel_rows

NAMESPACE = "spark_edge"
ROW_LOOP_MAX_ROWS = 8  # up to this many rows: tinygemm one row at a time; more: dequant + oneDNN

_lib = Library(NAMESPACE, "FRAGMENT")  # must outlive the ops registered into it


def check_activation_dtype(x: torch.Tensor) -> None:
    if x.dtype != torch.bfloat16:
        raise TypeError(
            f"cpu_int4 takes bfloat16 activations, got {x.dtype}; serve the model with dtype=bfloat16"
        )


def _weight_bf16(
    weight: torch.Tensor,
    scales_zeros: torch.Tensor,
    group_size: int,
    rm_packed: Optional[torch.Tensor],
    rm_scale: Optional[torch.Tensor],
    rm_zero: Optional[torch.Tensor],
) -> torch.Tensor:
    if rm_packed is None:
        return dequantize_kernel_weight(weight, scales_zeros, group_size)
    assert rm_scale is not None and rm_zero is not None
    return dequantize(unpack_nibbles(rm_packed), rm_scale, rm_zero, group_size).to(torch.bfloat16)


def _tinygemm(row: torch.Tensor, weight: torch.Tensor, group_size: int, scales_zeros: torch.Tensor) -> torch.Tensor:
    """One activation row through PyTorch's int4 kernel (only ever one: see the module docstring)."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(row.contiguous(), weight, group_size, scales_zeros)


def cpu_int4_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales_zeros: torch.Tensor,
    group_size: int,
    rm_packed: Optional[torch.Tensor],
    rm_scale: Optional[torch.Tensor],
    rm_zero: Optional[torch.Tensor],
) -> torch.Tensor:
    """x bf16 [M, K] @ W^T -> bf16 [M, N]; weight is the kernel buffer [N, K/2]."""
    check_activation_dtype(x)
    m = x.shape[0]
    if m == 0:
        return x.new_empty((0, weight.shape[0]))
    if m == 1:  # batch-1 decode: the hot path, kept free of Python work
        return _tinygemm(x, weight, group_size, scales_zeros)
    if m <= ROW_LOOP_MAX_ROWS:
        return torch.cat([_tinygemm(x[i : i + 1], weight, group_size, scales_zeros) for i in range(m)])
    weight_t = dequantize_kernel_weight_t(weight, scales_zeros, group_size) if rm_packed is None else None
    if weight_t is None:  # no C kernel, or a layer keeping its row-major copy: the same bf16 values via torch
        weight_t = _weight_bf16(weight, scales_zeros, group_size, rm_packed, rm_scale, rm_zero).t().contiguous()
    # one GEMM call shape (x @ contiguous W^T) whichever path made the weight, so results are bit-identical
    return torch.mm(x, weight_t)


def _cpu_int4_linear_fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales_zeros: torch.Tensor,
    group_size: int,
    rm_packed: Optional[torch.Tensor],
    rm_scale: Optional[torch.Tensor],
    rm_zero: Optional[torch.Tensor],
) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.bfloat16)


def cpu_int4_embedding(
    ids: torch.Tensor,
    weight: torch.Tensor,
    scales_zeros: torch.Tensor,
    group_size: int,
    rm_packed: Optional[torch.Tensor],
    rm_scale: Optional[torch.Tensor],
    rm_zero: Optional[torch.Tensor],
) -> torch.Tensor:
    """Token ids [T] -> bf16 rows [T, K] of the quantized table."""
    if rm_packed is None:
        return gather_kernel_rows(weight, scales_zeros, ids, group_size)
    assert rm_scale is not None and rm_zero is not None
    ids = ids.to(torch.int64)
    return dequantize(unpack_nibbles(rm_packed[ids]), rm_scale[ids], rm_zero[ids], group_size).to(torch.bfloat16)


def _cpu_int4_embedding_fake(
    ids: torch.Tensor,
    weight: torch.Tensor,
    scales_zeros: torch.Tensor,
    group_size: int,
    rm_packed: Optional[torch.Tensor],
    rm_scale: Optional[torch.Tensor],
    rm_zero: Optional[torch.Tensor],
) -> torch.Tensor:
    return torch.empty((ids.shape[0], weight.shape[1] * 2), dtype=torch.bfloat16, device=ids.device)


def _registered(name: str) -> bool:
    return hasattr(getattr(torch.ops, NAMESPACE), name)


def register_ops() -> None:
    """Define the ops once per process (a second call is a no-op)."""
    from vllm.utils.torch_utils import direct_register_custom_op

    for name, impl, fake in (
        ("cpu_int4_linear", cpu_int4_linear, _cpu_int4_linear_fake),
        ("cpu_int4_embedding", cpu_int4_embedding, _cpu_int4_embedding_fake),
    ):
        if not _registered(name):
            direct_register_custom_op(name, impl, fake_impl=fake, target_lib=_lib, dispatch_key="CPU")
