"""Group-wise asymmetric 4-bit quantization along K (the input dimension).

Convention (the one PyTorch's CPU int4 kernel computes):

    w = (q - 8) * scale + zero,    q in [0, 15]

so `zero` is the float value at code 8, not an integer zero point.  Each group of
`group_size` consecutive K elements of one output row has its own (scale, zero), both
stored as bfloat16.  The codes are chosen against the bf16-rounded scale and zero, so the
grid that is searched and scored is exactly the grid that is stored and served.

Range-shrink search: for every group, several grids are tried whose range is the
group's [min, max] shrunk symmetrically about its midpoint; the one with the smallest
squared error wins.  Clipping a few outliers buys a finer step for all the others
(similar to llama.cpp's make_qkx2_quants).  The fraction 1.0 (the plain min/max grid)
is always tried first and only a strictly smaller error replaces it, so the search is
never worse than plain min/max on any group.

Work is chunked over rows: only a bounded slice of the matrix is ever expanded to fp32
working copies, so a 131072 x 2048 embedding quantizes without a multi-GiB transient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

CODE_MAX = 15
CODE_MID = 8  # the code whose value is `zero`

# Range fractions tried by the shrink search; 1.0 (plain min/max) must come first.
SHRINK_FRACTIONS: tuple[float, ...] = (1.0, 0.98, 0.96, 0.94, 0.92, 0.90, 0.88, 0.85)
PLAIN: tuple[float, ...] = (1.0,)

# A group whose values are all equal has span 0; a tiny positive scale keeps the
# division finite and still decodes every element to `zero`.
MIN_SCALE = 1e-9

# fp32 elements per working chunk (~16 MiB per copy); the search holds a few copies.
DEFAULT_CHUNK_ELEMENTS = 4 << 20


@dataclass(frozen=True)
class GroupQuant:
    """One chunk of groups, quantized. Shapes: codes [R, G, g]; the rest [R, G]."""

    codes: torch.Tensor  # uint8, 0..15
    scale: torch.Tensor  # bfloat16
    zero: torch.Tensor  # bfloat16
    sq_err: torch.Tensor  # float32, sum of squared errors per group


@dataclass(frozen=True)
class Int4Weight:
    """A quantized [N, K] matrix in its checkpoint form."""

    packed: torch.Tensor  # uint8 [N, K/2], row-major nibbles (see pack_nibbles)
    scale: torch.Tensor  # bfloat16 [N, K/group_size]
    zero: torch.Tensor  # bfloat16 [N, K/group_size]
    group_size: int
    snr_db: float  # of the dequantized matrix against the input

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2


def bits_per_weight(group_size: int) -> float:
    """4-bit codes plus one bf16 scale and one bf16 zero per group."""
    return 4 + 32 / group_size


def check_shape(n: int, k: int, group_size: int) -> None:
    if group_size <= 0 or group_size % 2:
        raise ValueError(f"group size must be a positive even number, got {group_size}")
    if k % group_size:
        raise ValueError(f"K={k} is not a multiple of the group size {group_size}")
    if n <= 0 or k <= 0:
        raise ValueError(f"cannot quantize an empty matrix ({n} x {k})")


def _bf16_grid(lo: torch.Tensor, span: torch.Tensor, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 (scale, zero) of the grid covering [lo, lo + span * fraction], returned as fp32."""
    scale = torch.clamp(span * (fraction / CODE_MAX), min=MIN_SCALE)
    low = lo + span * ((1.0 - fraction) / 2)
    zero = low + CODE_MID * scale
    return scale.to(torch.bfloat16).float(), zero.to(torch.bfloat16).float()


def _codes_on_grid(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Nearest code of each element on the grid (scale, zero); fp32 [R, G, g]."""
    q = (w - zero.unsqueeze(-1)).div_(scale.unsqueeze(-1)).round_().add_(CODE_MID)
    return q.clamp_(0, CODE_MAX)


def quantize_groups(w: torch.Tensor, fractions: tuple[float, ...] = SHRINK_FRACTIONS) -> GroupQuant:
    """Quantize fp32 groups w [R, G, g], keeping per group the fraction with the least error."""
    if not fractions or fractions[0] != 1.0:
        raise ValueError("the fractions must start with 1.0 (the plain min/max grid)")
    w = w.float()
    lo = w.amin(dim=-1)
    span = w.amax(dim=-1) - lo
    best: GroupQuant | None = None
    for fraction in fractions:
        scale, zero = _bf16_grid(lo, span, fraction)
        q = _codes_on_grid(w, scale, zero)
        err = (q - CODE_MID).mul_(scale.unsqueeze(-1)).add_(zero.unsqueeze(-1)).sub_(w).square_().sum(dim=-1)
        if best is None:
            best = GroupQuant(q, scale, zero, err)
            continue
        better = err < best.sq_err  # strict: ties keep the earlier (wider) grid
        best = GroupQuant(
            torch.where(better.unsqueeze(-1), q, best.codes),
            torch.where(better, scale, best.scale),
            torch.where(better, zero, best.zero),
            torch.where(better, err, best.sq_err),
        )
    assert best is not None
    return GroupQuant(
        best.codes.to(torch.uint8), best.scale.to(torch.bfloat16), best.zero.to(torch.bfloat16), best.sq_err
    )


def _rows_per_chunk(k: int, chunk_elements: int) -> int:
    return max(1, chunk_elements // k)


def quantize(
    w: torch.Tensor,
    group_size: int,
    search: bool = True,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> Int4Weight:
    """Quantize a [N, K] matrix group-wise along K; returns the checkpoint tensors."""
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    check_shape(n, k, group_size)
    if not torch.isfinite(w).all():
        raise ValueError("the weight contains NaN or infinite values")
    fractions = SHRINK_FRACTIONS if search else PLAIN
    groups = k // group_size
    packed = torch.empty(n, k // 2, dtype=torch.uint8)
    scale = torch.empty(n, groups, dtype=torch.bfloat16)
    zero = torch.empty(n, groups, dtype=torch.bfloat16)
    signal = noise = 0.0
    rows = _rows_per_chunk(k, chunk_elements)
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        chunk = w[start:stop].float()
        gq = quantize_groups(chunk.view(stop - start, groups, group_size), fractions)
        packed[start:stop] = pack_nibbles(gq.codes.view(stop - start, k))
        scale[start:stop] = gq.scale
        zero[start:stop] = gq.zero
        signal += float(chunk.double().square().sum())
        noise += float(gq.sq_err.double().sum())
    return Int4Weight(packed, scale, zero, group_size, snr_from_sums(signal, noise))


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """(q - 8) * scale + zero in fp32: codes [M, K] (any integer dtype), scale/zero [M, K/g].

    This is the one definition of the arithmetic; every dequantization path (row-major
    codes, the kernel buffer, embedding rows) goes through it, so they agree bit for bit.
    """
    m, k = codes.shape
    w = codes.to(torch.float32).view(m, k // group_size, group_size)
    w.sub_(CODE_MID).mul_(scale.float().unsqueeze(-1)).add_(zero.float().unsqueeze(-1))
    return w.view(m, k)


def dequantize_weight(q: Int4Weight) -> torch.Tensor:
    """fp32 [N, K] of a checkpoint-form weight."""
    return dequantize(unpack_nibbles(q.packed), q.scale, q.zero, q.group_size)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0..15 -> [N, K/2] uint8; byte j = code 2j (low nibble) | code 2j+1 (high)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"K={codes.shape[-1]} is odd; codes pack two per byte")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_nibbles: [N, K/2] uint8 -> [N, K] uint8 codes."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).view(*packed.shape[:-1], packed.shape[-1] * 2)


def snr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-noise ratio of `approx` against `reference`, in dB (inf when identical)."""
    ref = reference.double()
    return snr_from_sums(float(ref.square().sum()), float((approx.double() - ref).square().sum()))


def snr_from_sums(signal: float, noise: float) -> float:
    """Signal-to-noise in dB from summed squares (inf when exact)."""
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)
