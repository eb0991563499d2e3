"""The cpu_int4 GEMM and embedding as opaque custom ops, and the choice of kernel for this host.

Why opaque: the GEMM picks its kernel by the number of activation rows.  Written inline,
that branch would become a dynamo guard on the batch size inside vLLM's single traced
graph; inside a custom op the compiled graph sees one call with a fake [M, N] result,
and the branch runs at call time.  The embedding lookup is opaque for the same reason
(its gather is data-dependent and gains nothing from inductor).

The GEMM is `torch.ops.spark_edge.int4_linear`, a C++ op (native_int4.py) that chooses per call,
by activation rows M and this host's policy (`host_policy`, set once per process):
- "q8", spark-edge's int8-activation GEMM, for decode rows (up to Q8_MAX_ROWS, Q8_MAX_ROWS_VNNI with
  vpdpbusd quads, AMX_MIN_ROWS - 1 where the AMX tiles take over): integer dot products against the
  4-bit codes, as llama.cpp does.
- "native", spark-edge's own int4 GEMM: every weight read from memory once per call whatever
  M, so batched decode of several streams costs little more than one (its vector paths serve
  the buffer layouts of ATen's AVX-512 and AVX2 kernels).  It serves up to TILES_MIN_ROWS - 1 rows
  where the bf16-tile GEMM serves, AMX_MIN_ROWS - 1 where the AMX one does, up to
  NATIVE_MAX_ROWS_BF16_HOST (16) on other hosts with bf16 GEMM hardware (arm64 BF16), and every M
  elsewhere: there oneDNN's bf16 GEMM converts to fp32 itself and the fused kernel measured 2-2.5x
  faster at 512 rows on AVX-512 (docs/int4-kernels.md), and ~40x on AVX2, where torch's bf16 mm has
  no vectorized path.
- "amx", spark-edge's AMX tile GEMM (AMX-BF16 builds on ATen's AVX-512 layout, where the process may
  use AMX tiles), from AMX_MIN_ROWS: panels of bf16 tiles of the weight (up to 4 x 64 channels x 512 K)
  dequantized into L2 and every row of the call run over them with tdpbf16ps, so prefill never writes a
  whole bf16 matrix: 2.5x the dequant + oneDNN path it replaces at 512 rows, on par with oneDNN's
  bf16 GEMM on a bf16 weight (docs/int4-kernels.md). Each thread releases its tiles after the call.
- "tiles", spark-edge's bf16-tile GEMM (AVX512-BF16 builds on ATen's AVX-512 layout), above
  TILES_MIN_ROWS on hosts without usable AMX: one tile of the weight (64 channels x 512 K) dequantized
  to bf16 into L2 at a time and every row of the call run over it with vdpbf16ps; it replaces "dequant"
  there and the fp32 native GEMM from 8 rows (docs/int4-kernels.md). Where the AMX policy meets a K
  that is not a multiple of 32, it serves instead of the AMX GEMM.
- "tinygemm", PyTorch's `_weight_int4pack_mm_for_cpu`, up to ROW_LOOP_MAX_ROWS (8) rows where the
  native GEMM has no vector path, one row per call and never several: on AMX hosts, tinygemm on
  a multi-row batch followed by vLLM's CPU attention in the same forward has been seen to die
  with SIGILL in the attention kernel (AMX tile state); single rows never trip it.
- "dequant", above those: the weight dequantized to bf16 in one pass, then oneDNN's GEMM.

Without a compiler (or with SPARK_EDGE_DISABLED_KERNELS=spark_edge_int4) the Python op `cpu_int4_linear`
makes the same choice without "native", on torch's own ops; it also serves layers that keep their row-major
checkpoint copy (quantization_config direct_dequant: false).

Only bf16 activations are accepted: the fp32 entry of the tinygemm op has no vectorized
path (tens of times slower), so a float32 model must fail clearly, not crawl.

Passing None vs the row-major tensors (rm_*) changes the traced graph, which is why that switch
is a config field (hashed into vLLM's compile-cache key).
"""

import functools
from typing import NamedTuple

import torch
from torch.library import Library

from spark_edge.environment import kernel_enabled
from spark_edge.formats.int4_asym import dequantize, unpack_nibbles
from spark_edge.formats.tinygemm_layout import dequantize_kernel_weight, detect_layout, gather_kernel_rows
from spark_edge.kernels.native_int4 import dequantize_kernel_weight_t, load_native_ops, native_gemm_vectorized
from spark_edge.probe.cpu_features import host_has_amx_bf16, host_has_bf16_gemm

NAMESPACE = "spark_edge"
ROW_LOOP_MAX_ROWS = 8  # without the native GEMM, up to this many rows: tinygemm one row at a time
NATIVE_MAX_ROWS_BF16_HOST = 16  # with bf16 GEMM hardware, more rows than this go to oneDNN (prefill)
Q8_MAX_ROWS = 4  # up to this many rows (decode), int8 activations and integer dot products (measured
# 1.3-2.2x the fp32-activation GEMM at 1 row, 1.1-1.6x at 2-4, even from 8 rows on AVX512BW: docs/int4-kernels.md)
Q8_MAX_ROWS_VNNI = 16  # with vpdpbusd quads (AVX512-VNNI) the int8 kernel stays ahead of the fp32 and bf16-tile
# GEMMs through 16 rows (AMD EPYC Zen 4, 1.7B shapes: 1.1-1.6x the tiles at 16 rows, 1.5-2x native at 8)
# int4_configure's `tiles`: the tile GEMM that serves above the native GEMM's rows (int4_kernels.h)
TILES = {"none": 0, "tiles": 1, "amx": 2}
AMX_MIN_ROWS = 17  # where the AMX tile GEMM serves, from here on: its cost is the weight's dequantization into
# tiles, nearly flat in the rows, while the int8 kernel's grows with them. Xeon AMX host, 2 threads: with the weights
# in cache (default-model and 1.7B layer shapes) they cross at 12-13 rows; streamed from DRAM (a 1.7B-shaped 1 GiB
# set, what decode of the mission's models meets) at ~20 (16 rows: int8 146 ms, tiles 173; 24: 200 against 167)
TILES_MIN_ROWS = 8  # where the bf16-tile GEMM serves, from here on (below, the fp32 native GEMM: ~1.3x faster
# at 5 rows, even at 8, behind from 16 on the 1.7B shapes of an AMD EPYC Zen 4)

_lib = Library(NAMESPACE, "FRAGMENT")  # must outlive the ops registered into it


def check_activation_dtype(x: torch.Tensor) -> None:
    if x.dtype != torch.bfloat16:
        raise TypeError(f"cpu_int4 takes bfloat16 activations, got {x.dtype}; serve the model with dtype=bfloat16")


def _weight_bf16(
    weight: torch.Tensor,
    scales_zeros: torch.Tensor,
    group_size: int,
    rm_packed: torch.Tensor | None,
    rm_scale: torch.Tensor | None,
    rm_zero: torch.Tensor | None,
) -> torch.Tensor:
    if rm_packed is None:
        return dequantize_kernel_weight(weight, scales_zeros, group_size)
    assert rm_scale is not None and rm_zero is not None
    return dequantize(unpack_nibbles(rm_packed), rm_scale, rm_zero, group_size).to(torch.bfloat16)


class KernelPolicy(NamedTuple):
    """What int4_linear runs for M rows: the int8-activation GEMM up to q8_max_rows (where the shape allows),
    the native GEMM up to native_max_rows (-1: every M, 0: never), then the tile GEMM named by `tiles`
    (TILES), else tinygemm one row at a time up to row_loop_max_rows and dequantization + oneDNN above."""

    q8_max_rows: int
    native_max_rows: int
    row_loop_max_rows: int
    tiles: int = 0


def bf16_tiles_available() -> bool:
    """Whether this build has the bf16-tile GEMM (vdpbf16ps) for this host's buffer layout."""
    layout = detect_layout()
    return load_native_ops() and bool(torch.ops.spark_edge.int4_bf16_tiles_supported(layout.block, layout.halves))


def amx_tiles_available() -> bool:
    """Whether this build has the AMX tile GEMM for this host's buffer layout and the process may use AMX."""
    layout = detect_layout()
    return load_native_ops() and bool(torch.ops.spark_edge.int4_amx_tiles_supported(layout.block, layout.halves))


def q8_max_rows() -> int:
    """Rows the int8-activation GEMM serves up to on this host: more where its form is vpdpbusd quads."""
    from spark_edge.kernels.native_int4 import Q8_FORMS

    return Q8_MAX_ROWS_VNNI if torch.ops.spark_edge.int4_q8_default_form() == Q8_FORMS["quads"] else Q8_MAX_ROWS


def host_policy() -> KernelPolicy:
    """This host's KernelPolicy, less the kernels SPARK_EDGE_DISABLED_KERNELS names (side-by-side benchmarks:
    `int4_gemm` leaves the tinygemm row loop and C dequantization + oneDNN, the kernels before the native GEMM)."""
    if not kernel_enabled("int4_gemm") or not native_gemm_vectorized():
        return KernelPolicy(0, 0, ROW_LOOP_MAX_ROWS)
    q8_max = q8_max_rows() if kernel_enabled("int4_gemm_q8") else 0
    if not host_has_bf16_gemm():  # oneDNN's bf16 GEMM converts to fp32 itself: the fp32 native GEMM wins
        return KernelPolicy(q8_max, -1, ROW_LOOP_MAX_ROWS)
    if kernel_enabled("int4_gemm_amx") and amx_tiles_available():
        return KernelPolicy(min(q8_max, AMX_MIN_ROWS - 1), AMX_MIN_ROWS - 1, ROW_LOOP_MAX_ROWS, TILES["amx"])
    if kernel_enabled("int4_gemm_bf16") and not host_has_amx_bf16() and bf16_tiles_available():
        return KernelPolicy(q8_max, TILES_MIN_ROWS - 1, ROW_LOOP_MAX_ROWS, TILES["tiles"])
    return KernelPolicy(q8_max, NATIVE_MAX_ROWS_BF16_HOST, ROW_LOOP_MAX_ROWS)


def kernel_for(m: int, n: int = 64, k: int = 64, group: int = 32) -> str:
    """ "q8", "native", "amx", "tiles", "tinygemm" or "dequant": the kernel int4_linear runs here for M
    activation rows of an N x K weight, as the C++ op's own dispatch decides it (int4_kernel_for); without
    the library, the Python op's rule."""
    if not load_native_ops():
        return "tinygemm" if m <= ROW_LOOP_MAX_ROWS else "dequant"
    layout = detect_layout()
    return torch.ops.spark_edge.int4_kernel_for(m, n, k, group, layout.block, layout.halves, *host_policy())


def _tinygemm(row: torch.Tensor, weight: torch.Tensor, group_size: int, scales_zeros: torch.Tensor) -> torch.Tensor:
    """One activation row through PyTorch's int4 kernel (only ever one: see the module docstring)."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(row.contiguous(), weight, group_size, scales_zeros)


def cpu_int4_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales_zeros: torch.Tensor,
    group_size: int,
    rm_packed: torch.Tensor | None,
    rm_scale: torch.Tensor | None,
    rm_zero: torch.Tensor | None,
) -> torch.Tensor:
    """x bf16 [M, K] @ W^T -> bf16 [M, N]; weight is the kernel buffer [N, K/2]."""
    check_activation_dtype(x)
    m = x.shape[0]
    if m == 0:
        return x.new_empty((0, weight.shape[0]))
    if m == 1:  # batch-1 decode: the hot path of this fallback, kept free of Python work
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
    rm_packed: torch.Tensor | None,
    rm_scale: torch.Tensor | None,
    rm_zero: torch.Tensor | None,
) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.bfloat16)


def cpu_int4_embedding(
    ids: torch.Tensor,
    weight: torch.Tensor,
    scales_zeros: torch.Tensor,
    group_size: int,
    rm_packed: torch.Tensor | None,
    rm_scale: torch.Tensor | None,
    rm_zero: torch.Tensor | None,
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
    rm_packed: torch.Tensor | None,
    rm_scale: torch.Tensor | None,
    rm_zero: torch.Tensor | None,
) -> torch.Tensor:
    return torch.empty((ids.shape[0], weight.shape[1] * 2), dtype=torch.bfloat16, device=ids.device)


def _registered(name: str) -> bool:
    return hasattr(getattr(torch.ops, NAMESPACE), name)


def native_linear_available() -> bool:
    """Whether torch.ops.spark_edge.int4_linear is loaded and configured for this host."""
    return register_ops()


@functools.cache
def register_ops() -> bool:
    """Define the Python ops and load the C++ ones with this host's policy, once per process (a second
    call is a no-op); True when the C++ int4_linear serves."""
    from vllm.utils.torch_utils import direct_register_custom_op

    for name, impl, fake in (
        ("cpu_int4_linear", cpu_int4_linear, _cpu_int4_linear_fake),
        ("cpu_int4_embedding", cpu_int4_embedding, _cpu_int4_embedding_fake),
    ):
        if not _registered(name):
            direct_register_custom_op(name, impl, fake_impl=fake, target_lib=_lib, dispatch_key="CPU")
    if not load_native_ops():
        return False
    layout = detect_layout()
    torch.ops.spark_edge.int4_configure(layout.block, layout.halves, *host_policy())
    return True
