"""A published AWQ checkpoint (AutoAWQ's GEMM export, 4-bit) read as it is, for the cpu_int4 kernels.

| tensor  | dtype | shape      | content                                                                      |
|---------|-------|------------|------------------------------------------------------------------------------|
| qweight | int32 | [K, N/8]   | codes, N packed 8 per word in AWQ's order (column 8j + m at nibble REVERSE_ORDER[m]) |
| qzeros  | int32 | [G, N/8]   | zero point per group and output, packed the same way                         |
| scales  | f16   | [G, N]     | scale per group and output                                                    |

AWQ decodes (q - z) * s (the zero point stored as is), which spark_edge.formats.rearrange_4bit turns into
cpu_int4's form. This module imports no vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from spark_edge.errors import CheckpointError
from spark_edge.formats.checkpoint_headers import expect_tensor, packed_layers
from spark_edge.formats.cpu_int4_config import GROUP_SIZES
from spark_edge.formats.gptq_layout import PACK
from spark_edge.formats.rearrange_4bit import CpuInt4Parts, cpu_int4_parts

SOURCE_METHOD = "awq"
METHOD = "cpu_int4_awq"  # the vLLM quantization method that reads them (passed as --quantization)
SUFFIXES = ("qweight", "qzeros", "scales")
# AutoAWQ packs columns 0..7 of a word at nibbles 0, 2, 4, 6, 1, 3, 5, 7: column m sits at nibble REVERSE_ORDER[m]
REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


@dataclass(frozen=True)
class AwqFormat:
    group_size: int
    not_converted: tuple[str, ...]  # modules_to_not_convert: layers whose name contains one stay unquantized

    @classmethod
    def from_hf(cls, quant: dict[str, Any]) -> AwqFormat:
        """Parse an AWQ quantization_config; raise ValueError for what the cpu_int4 kernels cannot serve."""
        if str(quant.get("quant_method", "")).lower() != SOURCE_METHOD:
            raise ValueError(f"quant_method is {quant.get('quant_method')!r}, not {SOURCE_METHOD!r}")
        bits = quant.get("bits", quant.get("w_bit"))
        if bits != 4:
            raise ValueError(f"bits={bits!r}: only 4-bit AWQ checkpoints are read")
        group = quant.get("group_size", quant.get("q_group_size"))
        if group not in GROUP_SIZES:
            raise ValueError(f"group_size={group!r}: the cpu_int4 kernels take groups of {list(GROUP_SIZES)}")
        if not quant.get("zero_point", True):
            raise ValueError("zero_point=false: only AWQ's asymmetric (zero point) export is read")
        version = str(quant.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"version={version!r}: only the GEMM layout is read")
        return cls(group, tuple(quant.get("modules_to_not_convert") or ()))


def published_awq(config: dict[str, Any]) -> bool:
    quant = config.get("quantization_config") or {}
    return str(quant.get("quant_method", "")).lower() == SOURCE_METHOD


def check_awq_tensors(folder: Path, config: dict[str, Any]) -> AwqFormat | None:
    """For an AWQ folder: its format, after every quantized layer's three tensors were checked against each other
    and the config (CheckpointError naming the first that does not fit); None for anything else."""
    if not published_awq(config):
        return None
    fmt, headers, layers = packed_layers(folder, config, AwqFormat.from_hf, "AWQ", "qweight")
    for prefix, (k, n8) in layers:
        if k % fmt.group_size:
            raise CheckpointError(
                f"{folder}: {prefix}.qweight {[k, n8]} holds K={k}, not a multiple of the group size {fmt.group_size}"
            )
        groups, n = k // fmt.group_size, n8 * PACK
        expect_tensor(folder, headers, f"{prefix}.qzeros", {"I32"}, (groups, n8))
        expect_tensor(folder, headers, f"{prefix}.scales", {"F16", "BF16", "F32"}, (groups, n))
    return fmt


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C/8] in AWQ's order -> uint8 [R, C]."""
    shifts = torch.tensor(REVERSE_ORDER, dtype=torch.int32) * 4
    return ((words.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8).reshape(words.shape[0], -1)


def to_cpu_int4(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, fmt: AwqFormat, where: str = "layer"
) -> CpuInt4Parts:
    """One AWQ layer as cpu_int4's (codes, scale, zero): the same decoded weights up to bf16 scales."""
    return cpu_int4_parts(unpack_awq(qweight).t(), unpack_awq(qzeros).t(), scales.t(), None, fmt.group_size, where)
