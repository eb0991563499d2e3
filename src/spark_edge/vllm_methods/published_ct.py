"""A published compressed-tensors W4A16 checkpoint (`pack-quantized`, llm-compressor's export) read as it is.

The quantization_config is parsed by the `compressed-tensors` library itself (its pydantic QuantizationConfig);
what the cpu_int4 kernels cannot serve is refused by name. Per quantized Linear (prefix P):

| tensor                | dtype | shape      | content                                                           |
|-----------------------|-------|------------|-------------------------------------------------------------------|
| P.weight_packed       | int32 | [N, K/8]   | codes + 8 (signed 4-bit stored unsigned), K packed 8 per word      |
| P.weight_scale        | float | [N, G]     | scale per output and group                                        |
| P.weight_zero_point   | int32 | [N/8, G]   | asymmetric only: zero point + 8, N packed 8 per word               |
| P.weight_shape        | int   | [2]        | [N, K]                                                            |
| P.weight_g_idx        | int32 | [K]        | actorder "group" only: the group of each input column              |

The library decodes (q - zp) * s with q, zp signed; stored unsigned that is (u - zu) * s, which
spark_edge.formats.rearrange_4bit turns into cpu_int4's form. This module imports no vLLM.
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

SOURCE_METHOD = "compressed-tensors"
METHOD = "cpu_int4_ct"  # the vLLM quantization method that reads them (passed as --quantization)
PACKED_FORMAT = "pack-quantized"


@dataclass(frozen=True)
class CtFormat:
    group_size: int
    symmetric: bool
    act_order: bool  # actorder "group": a weight_g_idx per layer
    ignore: tuple[str, ...]  # layer names or "re:" patterns left unquantized

    @classmethod
    def from_hf(cls, quant: dict[str, Any]) -> CtFormat:
        """Parse with compressed-tensors; raise ValueError for what the cpu_int4 kernels cannot serve."""
        from compressed_tensors.quantization import QuantizationConfig

        config = QuantizationConfig.model_validate(quant)
        groups = list(config.config_groups.values())
        if len(groups) != 1:
            raise ValueError(f"{len(groups)} config groups: one W4A16 scheme for every Linear is read")
        scheme = groups[0]
        fmt = getattr(scheme, "format", None) or config.format
        if fmt != PACKED_FORMAT:
            raise ValueError(f"format {fmt!r}: only {PACKED_FORMAT!r} is read")
        w = scheme.weights
        if w is None or scheme.input_activations is not None:
            raise ValueError("not weight-only: quantized activations are not read")
        if w.num_bits != 4 or str(w.type) not in ("int", "QuantizationType.INT"):
            raise ValueError(f"weights are {w.type} {w.num_bits}-bit: only 4-bit integers are read")
        if str(w.strategy).split(".")[-1].lower() != "group" or w.group_size not in GROUP_SIZES:
            raise ValueError(
                f"strategy {w.strategy}, group_size {w.group_size}: the cpu_int4 kernels take groups of "
                f"{list(GROUP_SIZES)}"
            )
        if [t for t in scheme.targets if t != "Linear"]:
            raise ValueError(f"targets {scheme.targets}: only ['Linear'] (every Linear but `ignore`) is read")
        act_order = str(w.actorder).split(".")[-1].lower() == "group" if w.actorder else False
        return cls(w.group_size, bool(w.symmetric), act_order, tuple(config.ignore or ()))


def published_ct(config: dict[str, Any]) -> bool:
    quant = config.get("quantization_config") or {}
    return str(quant.get("quant_method", "")).lower() == SOURCE_METHOD


def check_ct_tensors(folder: Path, config: dict[str, Any]) -> CtFormat | None:
    """For a compressed-tensors folder: its format, after every packed layer's tensors were checked against each
    other and the config (CheckpointError naming the first that does not fit); None for anything else."""
    if not published_ct(config):
        return None
    fmt, headers, layers = packed_layers(folder, config, CtFormat.from_hf, "compressed-tensors", "weight_packed")
    for prefix, (n, k8) in layers:
        k = k8 * PACK
        if k % fmt.group_size or n % PACK:
            raise CheckpointError(
                f"{folder}: {prefix}.weight_packed {[n, k8]} holds K={k}, N={n}: K must be a multiple of the group "
                f"size {fmt.group_size} and N of {PACK}"
            )
        groups = k // fmt.group_size
        expect_tensor(folder, headers, f"{prefix}.weight_scale", {"F16", "BF16", "F32"}, (n, groups))
        expect_tensor(folder, headers, f"{prefix}.weight_shape", {"I64", "I32"}, (2,))
        if not fmt.symmetric:
            expect_tensor(folder, headers, f"{prefix}.weight_zero_point", {"I32"}, (n // PACK, groups))
        if fmt.act_order:
            expect_tensor(folder, headers, f"{prefix}.weight_g_idx", {"I32", "I64"}, (k,))
    if fmt.act_order:
        check_shared_order(folder, [f"{prefix}.weight_g_idx" for prefix, _ in layers])
    return fmt


def to_cpu_int4(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None,
    weight_g_idx: torch.Tensor | None,
    fmt: CtFormat,
    where: str = "layer",
) -> CpuInt4Parts:
    """One compressed-tensors layer as cpu_int4's (codes, scale, zero): the same decoded weights up to bf16 scales."""
    codes = unpack_along_dim1(weight_packed)  # [N, K], unsigned
    zeros = None if weight_zero_point is None else unpack_along_dim0(weight_zero_point)  # [N, G], unsigned
    return cpu_int4_parts(codes, zeros, weight_scale, weight_g_idx, fmt.group_size, where)
