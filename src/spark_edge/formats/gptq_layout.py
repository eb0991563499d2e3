"""The AutoGPTQ ("gptq", v1) checkpoint tensors of one symmetric 4-bit Linear, and back.

For a weight W [N, K] (N outputs, K inputs) quantized in groups of g along K:

| tensor  | dtype | shape      | content                                                   |
|---------|-------|------------|-----------------------------------------------------------|
| qweight | int32 | [K/8, N]   | codes, K-major: word [j, n] holds k = 8j..8j+7, nibble i at bits 4i |
| qzeros  | int32 | [K/g, N/8] | stored zero point per group, N packed: nibble i = column 8c+i |
| scales  | bf16  | [K/g, N]   | the per-group scale (may be negative, see int4_sym)       |
| g_idx   | int32 | [K]        | group of input k: k // g (no activation reordering)       |

qzeros: checkpoint_format "gptq" (v1) stores the zero point minus one -- AutoGPTQ's
packer subtracts 1 and its kernels (and GPTQModel's v1->v2 conversion, and
transformers through them) add it back.  The symmetric 4-bit zero point is 8, so every
nibble is 7 (word 0x77777777).  vLLM 0.32 does not read qzeros of a sym checkpoint at
all: its CPU kernel drops the parameter and, for W4A8, synthesizes a zero point of 8
itself.  Writing 7 is what keeps the checkpoint correct for every other v1 reader; a
file with 0x88888888 would decode one step off there (zero 9).

vLLM's loader drops g_idx (desc_act is unsupported there); AutoGPTQ-style readers
expect it, so it is written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spark_edge.formats.int4_sym import (
    CODE_ZERO,
    DEFAULT_CHUNK_ELEMENTS,
    SCALE_DTYPE,
    check_shape,
    db,
    dequantize,
    quantize_rows,
)

PACK = 8  # 4-bit values per int32
BITS = 4
V1_ZERO_OFFSET = 1  # v1 stores zero point - 1
STORED_ZERO = CODE_ZERO - V1_ZERO_OFFSET  # 7


@dataclass(frozen=True)
class GPTQWeight:
    """One quantized Linear in AutoGPTQ layout (see the module docstring)."""

    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor
    group_size: int
    snr_db: float  # of the dequantized matrix against the input

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of the original weight."""
        return self.qweight.shape[1], self.qweight.shape[0] * PACK

    def tensors(self) -> dict[str, torch.Tensor]:
        """Checkpoint suffix -> tensor, in the order they are written."""
        return {"qweight": self.qweight, "qzeros": self.qzeros, "scales": self.scales, "g_idx": self.g_idx}


def tensor_shapes(n: int, k: int, group_size: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Checkpoint suffix -> (dtype, shape) of a [N, K] weight, without quantizing it."""
    check_layout(n, k, group_size)
    groups = k // group_size
    return {
        "qweight": (torch.int32, (k // PACK, n)),
        "qzeros": (torch.int32, (groups, n // PACK)),
        "scales": (SCALE_DTYPE, (groups, n)),
        "g_idx": (torch.int32, (k,)),
    }


def check_layout(n: int, k: int, group_size: int) -> None:
    check_shape(n, k, group_size)
    if n % PACK:
        raise ValueError(f"N={n} is not a multiple of {PACK} (qzeros pack 8 output columns per int32)")


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) -> the int32 with the same bits."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def pack_along_dim0(values: torch.Tensor) -> torch.Tensor:
    """[R, C] values 0..15 -> int32 [R/8, C]; word [j, c] = sum_i values[8j+i, c] << 4i."""
    r, c = values.shape
    if r % PACK:
        raise ValueError(f"{r} rows do not pack 8 per int32")
    v = values.to(torch.int64).view(r // PACK, PACK, c)
    shifts = torch.arange(0, BITS * PACK, BITS, dtype=torch.int64).view(1, PACK, 1)
    return _to_int32((v << shifts).sum(dim=1))


def unpack_along_dim0(words: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_along_dim0: int32 [R/8, C] -> uint8 [R, C]."""
    r8, c = words.shape
    shifts = torch.arange(0, BITS * PACK, BITS, dtype=torch.int32).view(1, PACK, 1)
    return ((words.unsqueeze(1) >> shifts) & 0xF).to(torch.uint8).reshape(r8 * PACK, c)


def pack_along_dim1(values: torch.Tensor) -> torch.Tensor:
    """[R, C] values 0..15 -> int32 [R, C/8]; word [r, j] = sum_i values[r, 8j+i] << 4i."""
    return pack_along_dim0(values.t()).t().contiguous()


def unpack_along_dim1(words: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_along_dim1: int32 [R, C/8] -> uint8 [R, C]."""
    return unpack_along_dim0(words.t()).t().contiguous()


def sym_qzeros(groups: int, n: int) -> torch.Tensor:
    """qzeros of a symmetric 4-bit v1 checkpoint: every nibble STORED_ZERO."""
    return pack_along_dim1(torch.full((groups, n), STORED_ZERO, dtype=torch.uint8))


def group_index(k: int, group_size: int) -> torch.Tensor:
    return torch.arange(k, dtype=torch.int32) // group_size


def quantize(
    w: torch.Tensor,
    group_size: int,
    search: bool = False,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> GPTQWeight:
    """Quantize W [N, K] symmetrically and lay it out for a GPTQ checkpoint.

    Rows of W are columns of qweight/scales, so each chunk of rows fills a column
    range; nothing bigger than one chunk is ever expanded.
    """
    n, k = w.shape
    check_layout(n, k, group_size)
    qweight = torch.empty(k // PACK, n, dtype=torch.int32)
    scales = torch.empty(k // group_size, n, dtype=SCALE_DTYPE)
    signal = noise = 0.0
    for chunk in quantize_rows(w, group_size, search, chunk_elements):
        qweight[:, chunk.start : chunk.stop] = pack_along_dim0(chunk.groups.codes.t())
        scales[:, chunk.start : chunk.stop] = chunk.groups.scale.t()
        signal += chunk.signal
        noise += float(chunk.groups.sq_err.double().sum())
    return GPTQWeight(
        qweight, sym_qzeros(k // group_size, n), scales, group_index(k, group_size), group_size, db(signal, noise)
    )


def stored_zero_points(q: GPTQWeight) -> torch.Tensor:
    """The zero point of every (group, column) as a v1 reader sees it: stored + 1."""
    return unpack_along_dim1(q.qzeros).to(torch.int32) + V1_ZERO_OFFSET


def dequantize_weight(q: GPTQWeight) -> torch.Tensor:
    """fp32 [N, K] as a v1 reader decodes it: (code - (stored zero + 1)) * scale.

    Reads the zero points from qzeros rather than assuming 8, so a wrong qzeros
    convention shows up here.
    """
    codes = unpack_along_dim0(q.qweight).t().to(torch.int32)  # [N, K]
    zeros = stored_zero_points(q).t()  # [N, K/g]
    shifted = codes - zeros.repeat_interleave(q.group_size, dim=1) + CODE_ZERO
    return dequantize(shifted, q.scales.t(), q.group_size)


def bits_per_weight(n: int, k: int, group_size: int) -> float:
    """Stored bits per weight of one layer: codes + scales + qzeros + g_idx."""
    nbytes = sum(
        dtype.itemsize * torch.Size(shape).numel() for dtype, shape in tensor_shapes(n, k, group_size).values()
    )
    return nbytes * 8 / (n * k)
