"""Per-row symmetric 8-bit quantization: the cpu_int4 format's 8-bit vocabulary table.

    w = q * scale,    q in [-127, 127],    one float32 scale per row (output channel)

The form oneDNN's int8 GEMM takes for weights (per-output-channel scales, no zero point), so the head's
GEMM reads the stored codes as they are; the embedding lookup decodes the rows it gathers. -128 is left
unused so the grid is symmetric. Chunked over rows like int4_asym: a 131072 x 2048 table never expands
to a whole fp32 copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spark_edge.formats.int4_asym import snr_from_sums

CODE_MAX = 127
BITS = 8
DEFAULT_CHUNK_ROWS = 4096


@dataclass(frozen=True)
class Int8Rows:
    codes: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N]
    snr_db: float  # of the decoded matrix against the input


def bits_per_weight(k: int) -> float:
    return BITS + 32 / k  # the code, plus a float32 scale per row of K


def quantize(w: torch.Tensor, chunk_rows: int = DEFAULT_CHUNK_ROWS) -> Int8Rows:
    if w.dim() != 2:
        raise ValueError(f"int8 rows: expected a 2-D matrix, got shape {list(w.shape)}")
    codes = torch.empty(w.shape, dtype=torch.int8)
    scale = torch.empty(w.shape[0], dtype=torch.float32)
    signal = noise = 0.0
    for start in range(0, w.shape[0], chunk_rows):
        rows = w[start : start + chunk_rows].float()
        # an all-zero row gets scale 1: every code 0 decodes to 0 exactly
        s = rows.abs().amax(dim=1) / CODE_MAX
        s = torch.where(s > 0, s, torch.ones_like(s))
        q = torch.round(rows / s[:, None]).clamp_(-CODE_MAX, CODE_MAX)
        codes[start : start + chunk_rows] = q.to(torch.int8)
        scale[start : start + chunk_rows] = s
        signal += float(rows.square().sum())
        noise += float((q * s[:, None] - rows).square().sum())
    return Int8Rows(codes, scale, snr_from_sums(signal, noise))


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale.float()[:, None]
