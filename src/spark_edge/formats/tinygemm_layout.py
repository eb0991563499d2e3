"""The weight buffer of PyTorch's CPU int4 GEMM ("tinygemm"), built and read back.

Build: `torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes_int32[N, K], 1)` returns
uint8 [N, K/2]; the GEMM `_weight_int4pack_mm_for_cpu(x_bf16, buf, group, scales_and_zeros)`
takes scales_and_zeros as bf16 [G, N, 2] (scale, zero) and computes (q - 8) * scale + zero.

The buffer's layout is not documented by PyTorch, and it depends on the CPU kernel ATen
dispatches to on the running machine (AVX-512, AVX2, or the portable kernel that aarch64
runs).  Every layout seen has the same shape, measured on torch 2.13.0+cpu:

- Output channels are cut into blocks of B ("full blocks"), then one tail block of the
  remaining r = N mod B channels (r is a multiple of 16; the packer refuses other N).
- A block of b channels occupies K * b/2 bytes laid out [K][b/2]: K is the outer axis.
- In a full block of the vector kernels, byte d of each run holds channel d in its low
  nibble and channel d + B/2 in its high nibble ("halves"); in the tail block, and in
  every block of the portable kernel, byte j holds channels 2j (low) and 2j + 1 (high).

  AVX-512: B = 64, halves.  AVX2: B = 32, halves.  Portable: B = 4 float lanes, adjacent.

Because blocks are independent, the buffer is built in chunks of whole blocks (the int32
codes the packer wants are 8x the packed size; a 131072 x 2048 table would need a 1 GiB
transient at once) and is byte-identical to packing the whole matrix.

Reading it back ("direct dequantization") means no row-major copy has to stay resident
for the multi-row GEMM path or the embedding lookup.  Since the layout is measured, not
promised, `detect_layout()` probes the running torch (a few KiB, once per process) and
picks the candidate that decodes the probe exactly; a torch that packs in none of these
ways fails loudly at load instead of serving wrong weights.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from spark_edge.formats.int4_asym import dequantize, unpack_nibbles

PACK_MULTIPLE = 16  # the packer requires N % 16 == 0
DEFAULT_REPACK_ROWS = 2048  # rows expanded to int32 at a time (16 MiB at K = 2048)
CHUNK_ALIGN = 256  # packing chunks start on a block boundary of every candidate layout


class LayoutError(RuntimeError):
    """The installed torch packs int4 weights differently from what this module decodes."""


@dataclass(frozen=True)
class KernelLayout:
    block: int  # output channels per full block
    halves: bool  # a full block's byte d holds channels d and d + block/2 (else 2j and 2j + 1)

    @property
    def name(self) -> str:
        return f"{self.block}-channel blocks, {'halves' if self.halves else 'adjacent pairs'}"


# Most likely first: the AVX-512 and AVX2 kernels, then the portable kernel's block (four
# float vectors: 16 channels with 128-bit NEON, 32 with 256-bit vectors), then wider ones.
CANDIDATES = (
    KernelLayout(64, True),
    KernelLayout(32, True),
    KernelLayout(16, False),
    KernelLayout(32, False),
    KernelLayout(64, False),
    KernelLayout(128, False),
    KernelLayout(256, False),
    KernelLayout(128, True),
    KernelLayout(256, True),
)


def kernel_supports(n: int) -> bool:
    """Whether the CPU int4 packer accepts N output channels."""
    return n > 0 and n % PACK_MULTIPLE == 0


def supports_direct_dequant(n: int) -> bool:
    """Whether codes can be read straight back from the kernel buffer of N channels.

    Full blocks and the 16-multiple tail are both decoded, so this holds for every N the
    packer accepts; e.g. N = 80 (one 64-channel block + a 16-channel tail) works.
    Anything else cannot be packed for the kernel at all.
    """
    return kernel_supports(n)


def _pack_chunk(packed_rows: torch.Tensor) -> torch.Tensor:
    codes = unpack_nibbles(packed_rows).to(torch.int32)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)


def pack_for_kernel(packed: torch.Tensor, chunk_rows: int = DEFAULT_REPACK_ROWS) -> torch.Tensor:
    """Row-major nibbles uint8 [N, K/2] -> the kernel buffer uint8 [N, K/2].

    chunk_rows is rounded down to a multiple of CHUNK_ALIGN (at least that); 0 packs the
    whole matrix at once.  Chunk boundaries fall on block boundaries of every candidate
    layout, so the result does not depend on chunk_rows.
    """
    n, half_k = packed.shape
    if not kernel_supports(n):
        raise ValueError(f"the CPU int4 kernel needs N % {PACK_MULTIPLE} == 0, got N={n}")
    rows = n if chunk_rows <= 0 else max(CHUNK_ALIGN, chunk_rows // CHUNK_ALIGN * CHUNK_ALIGN)
    out = torch.empty(n, half_k, dtype=torch.uint8)
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        chunk = _pack_chunk(packed[start:stop])
        if chunk.shape != (stop - start, half_k):
            raise LayoutError(f"the int4 packer returned {tuple(chunk.shape)} for {stop - start} x {half_k * 2}")
        out[start:stop] = chunk
    return out


def scales_and_zeros(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """scale, zero bf16 [N, G] -> the kernel's bf16 [G, N, 2]."""
    return torch.stack((scale, zero), dim=-1).to(torch.bfloat16).transpose(0, 1).contiguous()


def split_scales_and_zeros(sz: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of scales_and_zeros, as [N, G] views (no copy)."""
    return sz[..., 0].t(), sz[..., 1].t()


def _block_codes(buf: torch.Tensor, blocks: int, size: int, k: int, halves: bool) -> torch.Tensor:
    """`blocks` blocks of `size` channels, [blocks * K * size/2] bytes -> codes [blocks * size, K]."""
    v = buf.view(blocks, k, size // 2)
    if halves:
        codes = torch.cat((v & 0xF, v >> 4), dim=-1)  # [blocks, K, size]: channel on the last axis
    else:
        codes = torch.stack((v & 0xF, v >> 4), dim=-1).view(blocks, k, size)
    return codes.transpose(1, 2).reshape(blocks * size, k)


def kernel_codes(buf: torch.Tensor, layout: KernelLayout | None = None) -> torch.Tensor:
    """The kernel buffer uint8 [N, K/2] -> codes uint8 [N, K] in row order."""
    layout = layout or detect_layout()
    n, half_k = buf.shape
    k = half_k * 2
    flat = buf.reshape(-1)
    full = n // layout.block * layout.block
    parts = []
    if full:
        parts.append(_block_codes(flat[: full * half_k], full // layout.block, layout.block, k, layout.halves))
    if n > full:
        parts.append(_block_codes(flat[full * half_k :], 1, n - full, k, halves=False))
    return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts)


def dequantize_kernel_weight(buf: torch.Tensor, sz: torch.Tensor, group_size: int) -> torch.Tensor:
    """bf16 [N, K] weight straight from the kernel buffer and its scales_and_zeros."""
    scale, zero = split_scales_and_zeros(sz)
    return dequantize(kernel_codes(buf), scale, zero, group_size).to(torch.bfloat16)


def kernel_row_codes(buf: torch.Tensor, rows: torch.Tensor, layout: KernelLayout | None = None) -> torch.Tensor:
    """Codes uint8 [M, K] of the given output channels (e.g. token ids), read in place.

    Cost is proportional to M * K, not N * K: each row is a strided gather of K bytes
    (one per K step of its block), of which one nibble per byte is kept.
    """
    layout = layout or detect_layout()
    n, half_k = buf.shape
    k = half_k * 2
    block, rows = layout.block, rows.to(torch.int64)
    full = n // block * block
    in_full = rows < full
    first = rows // block * block  # the row's block starts at this channel, and at first * K/2 bytes
    c = rows - first  # channel within its block
    run = torch.where(in_full, block // 2, (n - full) // 2)  # bytes per K step in the row's block
    if layout.halves:
        column = torch.where(in_full, c % (block // 2), c // 2)
        high = torch.where(in_full, c >= block // 2, c % 2 == 1)
    else:
        column, high = c // 2, c % 2 == 1
    index = (first * half_k + column).unsqueeze(1) + torch.arange(k).unsqueeze(0) * run.unsqueeze(1)
    return (buf.reshape(-1)[index] >> (4 * high.to(torch.uint8)).unsqueeze(1)) & 0xF


def gather_kernel_rows(buf: torch.Tensor, sz: torch.Tensor, rows: torch.Tensor, group_size: int) -> torch.Tensor:
    """bf16 [M, K] dequantized rows (embedding lookup) straight from the kernel buffer."""
    scale, zero = split_scales_and_zeros(sz)
    rows = rows.to(torch.int64)
    return dequantize(kernel_row_codes(buf, rows), scale[rows], zero[rows], group_size).to(torch.bfloat16)


# tail only, one block of every width, blocks + tails, several blocks of every candidate
PROBE_CHANNELS = (16, 48, 64, 80, 192, 272, 528)


def _probe_codes(n: int, k: int) -> torch.Tensor:
    # distinct codes per (row, k) neighbourhood, so a misplaced nibble cannot go unnoticed
    return ((torch.arange(n).unsqueeze(1) * 7 + torch.arange(k) * 3 + torch.arange(n).unsqueeze(1) // 16) % 16).to(
        torch.uint8
    )


def _decodes(layout: KernelLayout, probes: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> bool:
    for n, (codes, packed) in probes.items():
        rows = torch.arange(n - 1, -1, -5)
        if not (
            torch.equal(kernel_codes(packed, layout), codes)
            and torch.equal(kernel_row_codes(packed, rows, layout), codes[rows])
        ):
            return False
    return True


@functools.cache
def detect_layout() -> KernelLayout:
    """The layout the running torch packs in (see the module docstring); raise LayoutError if none fits."""
    k = 64
    probes = {}
    for n in PROBE_CHANNELS:
        codes = _probe_codes(n, k)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        if tuple(packed.shape) != (n, k // 2) or packed.dtype != torch.uint8:
            raise LayoutError(
                f"int4 packer output is {tuple(packed.shape)} {packed.dtype}, "
                f"expected ({n}, {k // 2}) uint8 (torch {torch.__version__})"
            )
        probes[n] = (codes, packed)
    for layout in CANDIDATES:
        if _decodes(layout, probes):
            return layout
    raise LayoutError(
        f"the int4 kernel buffer of torch {torch.__version__} is in none of the known layouts "
        f"({'; '.join(c.name for c in CANDIDATES)})"
    )
