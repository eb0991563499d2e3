"""A published 4-bit layer's codes, zero points and scales as cpu_int4's (codes, scale, zero): no requantizing.

Every published 4-bit format read here decodes w[n, k] = (q - z) * s, q and z unsigned 4-bit, s per group
of K. cpu_int4 decodes (q - 8) * scale + zero, so scale = s and zero = (8 - z) * s, both bf16 (the kernel's
scales_and_zeros): the one rounding added, a relative 2^-9 on each group's scale and offset, never the codes.

Act-order (a g_idx that is not k // g): the input columns are sorted by group once, at load, so each group is
contiguous again; the layer permutes its activations the same way before the GEMM (`order`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from spark_edge.errors import CheckpointError
from spark_edge.formats.int4_asym import pack_nibbles

CODE_ZERO = 8  # cpu_int4's code offset


@dataclass(frozen=True)
class CpuInt4Parts:
    packed: torch.Tensor  # uint8 [N, K/2], inputs in `order`
    scale: torch.Tensor  # bf16 [N, G]
    zero: torch.Tensor  # bf16 [N, G]
    order: torch.Tensor | None  # int64 [K]: the activation columns the GEMM reads (None: as they come)


def input_order(g_idx: torch.Tensor | None, group_size: int, where: str) -> torch.Tensor | None:
    """The column order that makes each group contiguous; None when it already is (no act-order)."""
    if g_idx is None:
        return None
    k = g_idx.numel()
    g = g_idx.to(torch.int64)
    if torch.equal(g, torch.arange(k) // group_size):
        return None
    if int(g.min()) < 0 or int(g.max()) >= k // group_size:
        raise ValueError(f"{where}: g_idx holds groups {int(g.min())}..{int(g.max())}, not 0..{k // group_size - 1}")
    counts = torch.bincount(g, minlength=k // group_size)
    if bool((counts != group_size).any()):
        raise ValueError(f"{where}: g_idx does not give every group {group_size} columns; it cannot be reordered")
    return torch.sort(g, stable=True).indices


def cpu_int4_parts(
    codes: torch.Tensor,
    zeros: torch.Tensor | None,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
    where: str = "layer",
) -> CpuInt4Parts:
    """codes uint8 [N, K], zeros [N, G] unsigned (None: symmetric, 8), scales [N, G], g_idx [K] or None."""
    order = input_order(g_idx, group_size, where)
    if order is not None:
        codes = codes.index_select(1, order)
    s = scales.to(torch.float32)
    zero = torch.zeros_like(s) if zeros is None else (CODE_ZERO - zeros.to(torch.float32)) * s
    return CpuInt4Parts(
        packed=pack_nibbles(codes.contiguous()),
        scale=s.to(torch.bfloat16).contiguous(),
        zero=zero.to(torch.bfloat16).contiguous(),
        order=order,
    )


# Layers vLLM loads into one merged layer (one g_idx for all its parts), by the names published checkpoints use.
FUSED_PARTS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def check_shared_order(folder: Path, g_idx_names: list[str]) -> None:
    """Act-order checkpoints: the parts of a merged layer read the same activations, so GPTQ sorts them alike; a
    merged layer holds one g_idx, so parts that differ are refused (CheckpointError naming them), not served
    with the wrong column order."""
    names = set(g_idx_names)
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            tensors.update({n: f.get_tensor(n) for n in f.keys() if n in names})
    for name in sorted(names):
        for parts in FUSED_PARTS:
            first = f".{parts[0]}."
            if first not in name:
                continue
            for part in parts[1:]:
                other = name.replace(first, f".{part}.")
                if other in tensors and not torch.equal(tensors[name], tensors[other]):
                    raise CheckpointError(
                        f"{folder}: {name} and {other} differ; vLLM merges these layers into one with a single "
                        "column order, so act-order parts must share it"
                    )
