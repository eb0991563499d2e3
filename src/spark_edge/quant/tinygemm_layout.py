"""The weight buffer of PyTorch's CPU int4 GEMM ("tinygemm"), built and read back.

Build: `torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes_int32[N, K], 1)` returns
uint8 [N, K/2]; the GEMM `_weight_int4pack_mm_for_cpu(x_bf16, buf, group, scales_and_zeros)`
takes scales_and_zeros as bf16 [G, N, 2] (scale, zero) and computes (q - 8) * scale + zero.

The buffer's layout is not documented by PyTorch.  Measured on torch 2.13.0+cpu (AVX-512):

- Output channels are cut into blocks of 64 ("full blocks"), then one tail block of the
  remaining r = N mod 64 channels (r is a multiple of 16; the packer refuses other N).
- A full block occupies K * 32 bytes laid out [K][32]: K is the outer axis, and byte d of
  each 32-byte run holds channel d of the block in its low nibble and channel d + 32 in
  its high nibble.
- The tail block occupies K * r/2 bytes laid out [K][r/2]: byte j holds channel 2j (low
  nibble) and channel 2j + 1 (high nibble).  (An N below 64 is all tail.)

Because blocks are independent, the buffer is built in chunks of 64-multiple rows (the
int32 codes the packer wants are 8x the packed size; a 131072 x 2048 table would need a
1 GiB transient at once) and is byte-identical to packing the whole matrix.

Reading it back ("direct dequantization") means no row-major copy has to stay resident
for the multi-row GEMM path or the embedding lookup.  Since the layout is measured, not
promised, `check_layout()` re-verifies it against the running torch (a few KiB probe,
once per process) before any buffer is trusted; a torch that packs differently fails
loudly at load instead of serving wrong weights.
"""

from __future__ import annotations

import functools

import torch

from spark_edge.quant.int4_asym import dequantize, unpack_nibbles

BLOCK = 64  # output channels per full block
PACK_MULTIPLE = 16  # the packer requires N % 16 == 0
DEFAULT_REPACK_ROWS = 2048  # rows expanded to int32 at a time (16 MiB at K = 2048)


class LayoutError(RuntimeError):
    """The installed torch packs int4 weights differently from what this module decodes."""


def kernel_supports(n: int) -> bool:
    """Whether the CPU int4 packer accepts N output channels."""
    return n > 0 and n % PACK_MULTIPLE == 0


def supports_direct_dequant(n: int) -> bool:
    """Whether codes can be read straight back from the kernel buffer of N channels.

    Full 64-channel blocks and the 16/32/48-channel tail are both decoded, so this holds
    for every N the packer accepts; e.g. N = 80 (one block + a 16-channel tail) works.
    Anything else cannot be packed for the kernel at all.
    """
    return kernel_supports(n)


def _pack_chunk(packed_rows: torch.Tensor) -> torch.Tensor:
    codes = unpack_nibbles(packed_rows).to(torch.int32)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)


def pack_for_kernel(packed: torch.Tensor, chunk_rows: int = DEFAULT_REPACK_ROWS) -> torch.Tensor:
    """Row-major nibbles uint8 [N, K/2] -> the kernel buffer uint8 [N, K/2].

    chunk_rows is rounded down to a multiple of 64 (at least 64); 0 packs the whole
    matrix at once.  Chunk boundaries fall on block boundaries, so the result does not
    depend on chunk_rows.
    """
    n, half_k = packed.shape
    if not kernel_supports(n):
        raise ValueError(f"the CPU int4 kernel needs N % {PACK_MULTIPLE} == 0, got N={n}")
    rows = n if chunk_rows <= 0 else max(BLOCK, chunk_rows // BLOCK * BLOCK)
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


def _full_block_codes(buf: torch.Tensor, blocks: int, k: int) -> torch.Tensor:
    """[blocks * K * 32] bytes -> codes [blocks * 64, K]."""
    v = buf.view(blocks, k, BLOCK // 2)
    codes = torch.cat((v & 0xF, v >> 4), dim=-1)  # [blocks, K, 64]: channel on the last axis
    return codes.transpose(1, 2).reshape(blocks * BLOCK, k)


def _tail_codes(buf: torch.Tensor, r: int, k: int) -> torch.Tensor:
    """[K * r/2] bytes -> codes [r, K]."""
    v = buf.view(k, r // 2)
    return torch.stack((v & 0xF, v >> 4), dim=-1).view(k, r).t()


def kernel_codes(buf: torch.Tensor) -> torch.Tensor:
    """The kernel buffer uint8 [N, K/2] -> codes uint8 [N, K] in row order."""
    n, half_k = buf.shape
    k = half_k * 2
    flat = buf.reshape(-1)
    full = n // BLOCK * BLOCK
    parts = []
    if full:
        parts.append(_full_block_codes(flat[: full * half_k], full // BLOCK, k))
    if n > full:
        parts.append(_tail_codes(flat[full * half_k :], n - full, k))
    return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts)


def dequantize_kernel_weight(buf: torch.Tensor, sz: torch.Tensor, group_size: int) -> torch.Tensor:
    """bf16 [N, K] weight straight from the kernel buffer and its scales_and_zeros."""
    scale, zero = split_scales_and_zeros(sz)
    return dequantize(kernel_codes(buf), scale, zero, group_size).to(torch.bfloat16)


def kernel_row_codes(buf: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Codes uint8 [M, K] of the given output channels (e.g. token ids), read in place.

    Cost is proportional to M * K, not N * K: each row is a strided gather of K bytes,
    of which one nibble per byte is kept.
    """
    n, half_k = buf.shape
    k = half_k * 2
    rows = rows.to(torch.int64)
    flat = buf.reshape(-1)
    full = n // BLOCK * BLOCK
    tail = n - full
    in_full = rows < full
    picked_full = picked_tail = None
    if full:
        # full-block channel: block b = row // 64, byte column row % 32, high nibble if row % 64 >= 32
        v = flat[: full * half_k].view(full // BLOCK, k, BLOCK // 2)
        block = (rows // BLOCK).clamp(max=full // BLOCK - 1)
        picked_full = v[block, :, rows % (BLOCK // 2)]
        shift_full = 4 * ((rows % BLOCK) // (BLOCK // 2))
    if tail:
        # tail channel t: byte column t // 2, high nibble if t is odd
        vt = flat[full * half_k :].view(k, tail // 2)
        t = (rows - full).clamp(min=0)
        picked_tail = vt[:, t // 2].t()
        shift_tail = 4 * (t % 2)
    if picked_tail is None:
        picked, shift = picked_full, shift_full
    elif picked_full is None:
        picked, shift = picked_tail, shift_tail
    else:
        picked = torch.where(in_full.unsqueeze(1), picked_full, picked_tail)
        shift = torch.where(in_full, shift_full, shift_tail)
    return (picked >> shift.to(torch.uint8).unsqueeze(1)) & 0xF


def gather_kernel_rows(buf: torch.Tensor, sz: torch.Tensor, rows: torch.Tensor, group_size: int) -> torch.Tensor:
    """bf16 [M, K] dequantized rows (embedding lookup) straight from the kernel buffer."""
    scale, zero = split_scales_and_zeros(sz)
    rows = rows.to(torch.int64)
    return dequantize(kernel_row_codes(buf, rows), scale[rows], zero[rows], group_size).to(torch.bfloat16)


def _probe(n: int, k: int) -> None:
    # distinct codes per (row, k) so a misplaced nibble cannot go unnoticed
    codes = ((torch.arange(n).unsqueeze(1) * 7 + torch.arange(k) * 3) % 16).to(torch.uint8)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    if tuple(packed.shape) != (n, k // 2) or packed.dtype != torch.uint8:
        raise LayoutError(f"int4 packer output is {tuple(packed.shape)} {packed.dtype}, expected ({n}, {k // 2}) uint8")
    if not torch.equal(kernel_codes(packed), codes):
        raise LayoutError(f"the int4 kernel buffer layout changed (torch {torch.__version__}, N={n})")
    rows = torch.arange(n - 1, -1, -5)
    if not torch.equal(kernel_row_codes(packed, rows), codes[rows]):
        raise LayoutError(f"row lookup from the int4 kernel buffer is wrong (torch {torch.__version__}, N={n})")


@functools.lru_cache(maxsize=None)
def check_layout() -> None:
    """Raise LayoutError unless the running torch packs exactly as documented above."""
    for n in (16, 48, 64, 80, 192):  # tail only, full block, block + tail, several blocks
        _probe(n, 64)
