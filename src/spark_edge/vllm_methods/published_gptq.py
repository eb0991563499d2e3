"""A published GPTQ checkpoint (AutoGPTQ / GPTQModel export, 4-bit) read as it is, for the cpu_int4 kernels.

Nothing is requantized: each layer's codes, zero points and scales are rearranged at load into cpu_int4's
row-major form (spark_edge.vllm_methods.cpu_int4_layers), which then builds the kernel buffers as for a w4a16 build.

| tensor  | dtype | shape      | content                                                            |
|---------|-------|------------|--------------------------------------------------------------------|
| qweight | int32 | [K/8, N]   | codes, K packed 8 per word (nibble i of word j: input 8j + i)      |
| qzeros  | int32 | [G, N/8]   | zero point per group and output, N packed 8 per word                |
| scales  | f16   | [G, N]     | scale per group and output                                          |
| g_idx   | int32 | [K]        | the group of each input column (act-order: a permutation of k // g) |

GPTQ decodes w[n, k] = (q - z) * s with z = stored + 1 for checkpoint_format "gptq" (v1: AutoGPTQ's
packer stores the zero point minus one) and z = stored for "gptq_v2"; spark_edge.formats.rearrange_4bit turns
that into cpu_int4's form (and sorts act-order's columns).

This module imports no vLLM: `serve` checks a folder with it before starting the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from spark_edge.errors import CheckpointError
from spark_edge.formats.checkpoint_headers import expect_tensor, packed_layers
from spark_edge.formats.cpu_int4_config import GROUP_SIZES
from spark_edge.formats.gptq_layout import PACK, unpack_along_dim0, unpack_along_dim1
from spark_edge.formats.rearrange_4bit import CpuInt4Parts, check_shared_order, cpu_int4_parts

SOURCE_METHOD = "gptq"  # quantization_config.quant_method of the checkpoints read here
METHOD = "cpu_int4_gptq"  # the vLLM quantization method that reads them (passed as --quantization)
FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> what is added to a stored zero point
SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class GptqFormat:
    group_size: int
    zero_offset: int  # 1 for v1 checkpoints, 0 for v2
    sym: bool
    desc_act: bool

    @classmethod
    def from_hf(cls, quant: dict[str, Any]) -> GptqFormat:
        """Parse a GPTQ quantization_config; raise ValueError for what the cpu_int4 kernels cannot serve."""
        if str(quant.get("quant_method", "")).lower() != SOURCE_METHOD:
            raise ValueError(f"quant_method is {quant.get('quant_method')!r}, not {SOURCE_METHOD!r}")
        if quant.get("bits") != 4:
            raise ValueError(f"bits={quant.get('bits')!r}: only 4-bit GPTQ checkpoints are read")
        group = quant.get("group_size")
        if group not in GROUP_SIZES:
            raise ValueError(f"group_size={group!r}: the cpu_int4 kernels take groups of {list(GROUP_SIZES)}")
        fmt = quant.get("checkpoint_format", "gptq")
        if fmt not in FORMATS:
            raise ValueError(f"checkpoint_format={fmt!r}: known formats are {list(FORMATS)}")
        if quant.get("dynamic"):
            raise ValueError("per-module overrides ('dynamic') are not read: every layer must share one format")
        if quant.get("lm_head"):
            raise ValueError("a quantized lm_head is not read (the head is served in bf16)")
        return cls(group, FORMATS[fmt], bool(quant.get("sym", True)), bool(quant.get("desc_act", False)))


def published_gptq(config: dict[str, Any]) -> bool:
    """Is this config.json a published GPTQ checkpoint's (whatever its settings)?"""
    quant = config.get("quantization_config") or {}
    return str(quant.get("quant_method", "")).lower() == SOURCE_METHOD


# -- checked before the engine starts ------------------------------------------------------------


def check_gptq_tensors(folder: Path, config: dict[str, Any]) -> GptqFormat | None:
    """For a published GPTQ folder: its format, after every quantized layer's four tensors were checked against
    each other and the config (CheckpointError naming the first that does not fit); None for anything else."""
    if not published_gptq(config):
        return None
    fmt, headers, layers = packed_layers(folder, config, GptqFormat.from_hf, "GPTQ", "qweight")
    for prefix, (k8, n) in layers:
        k = k8 * PACK
        if k % fmt.group_size or n % PACK:
            raise CheckpointError(
                f"{folder}: {prefix}.qweight {[k8, n]} holds K={k}, N={n}: K must be a multiple of the group size "
                f"{fmt.group_size} and N of {PACK}"
            )
        groups = k // fmt.group_size
        expect_tensor(folder, headers, f"{prefix}.qzeros", {"I32"}, (groups, n // PACK))
        expect_tensor(folder, headers, f"{prefix}.scales", {"F16", "BF16", "F32"}, (groups, n))
        expect_tensor(folder, headers, f"{prefix}.g_idx", {"I32", "I64"}, (k,))
    if fmt.desc_act:
        check_shared_order(folder, [f"{prefix}.g_idx" for prefix, _ in layers])
    return fmt


# -- at load: one layer into cpu_int4's form ----------------------------------------------------------


def to_cpu_int4(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    fmt: GptqFormat,
    where: str = "layer",
) -> CpuInt4Parts:
    """One GPTQ layer as cpu_int4's (codes, scale, zero): the same decoded weights up to bf16 scales."""
    codes = unpack_along_dim0(qweight).t()  # [N, K]
    zeros = unpack_along_dim1(qzeros).to(torch.int32) + fmt.zero_offset  # [G, N]
    return cpu_int4_parts(codes, zeros.t(), scales.t(), g_idx, fmt.group_size, where)


def dequantize_gptq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, fmt: GptqFormat
) -> torch.Tensor:
    """float64 [N, K] as a GPTQ reader decodes it: (q - z) * s, each column with its g_idx group."""
    codes = unpack_along_dim0(qweight).to(torch.float64)  # [K, N]
    z = unpack_along_dim1(qzeros).to(torch.float64) + fmt.zero_offset  # [G, N]
    g = g_idx.to(torch.int64)
    return ((codes - z[g]) * scales.to(torch.float64)[g]).t()
