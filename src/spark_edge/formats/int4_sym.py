"""Group-wise symmetric 4-bit quantization along K, for vLLM's GPTQ CPU kernels.

Convention (the one vLLM's CPU kernels compute for a symmetric GPTQ checkpoint,
quant type uint4b8):

    w = (q - 8) * scale,    q in [0, 15]

The zero point is the constant 8: vLLM's W4A8 path (`int4_scaled_mm_cpu`) builds a
zero point of 8 for every group and its W4A16 path (`cpu_gemm_wna16`) applies the
type's bias of 8; neither reads a per-group zero from the checkpoint.  So each group of
`group_size` consecutive K elements of one output row has only a scale, stored as
bfloat16: vLLM creates the GPTQ `scales` parameter in the model dtype, and its W4A8
path only runs with bf16 activations, so a bf16 checkpoint scale is loaded bit for bit
(an fp16 one would be rounded a second time on load).  Codes are chosen against the
bf16-rounded scale, so the grid that is searched and scored is exactly the one served.

The grid has 8 levels below zero and 7 above.  A scale may be negative (the
arithmetic above is linear in it; llama.cpp's Q4_0 does the same): that puts the
group's extreme value on the 8-level side whatever its sign.

Plain grid: scale = -e / 8, where e is the group's signed extreme (the element of
largest magnitude).  It is the finest step that still represents the extreme exactly,
like Q4_0; the other tail keeps 7 steps, so an element of the opposite sign beyond 7/8
of |e| is clipped by at most one step.  Compared with the classic positive amax/7 grid
(no clipping at all) the step is 1/8 finer; compared with the positive amax/8 grid it
never clips the extreme itself.

Search (`search=True`): per group, a few scales are tried (see `candidates`) and the one
with the least squared error is kept.  Divisors above 8 clip the tails to give every
other element a finer step (the outlier trade-off of llama.cpp's make_qx_quants).  The
positive amax/7 and amax/8 grids are always among the candidates, and a candidate
replaces the current best only if its error is strictly smaller, so the search is never
worse than either of them, nor than the plain grid, on any group.

Squared weight error is not what the model feels, though.  Measured on the default
model (fake quantization, g64, perplexity against its own bf16 over 2k tokens): plain
grid x1.57, positive amax/7 x1.87, positive amax/8 x3.42, search x2.71 -- the search gains
0.4 dB of weight SNR by clipping group extremes, and the extremes are what matters
(at g32: plain x1.32, search x1.67).  So the w4a8 weight path defaults to the plain grid.

Work is chunked over rows, so a 131072 x 2048 matrix never expands to a multi-GiB fp32
working copy.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

CODE_MAX = 15
CODE_ZERO = 8  # the fixed zero point: code 8 decodes to 0.0
SCALE_DTYPE = torch.bfloat16

# Candidate grids, as (sign, divisor): scale = sign * e / divisor, e the group's signed
# extreme.  First the plain grid (extreme on the 8-level side), then the positive amax/7
# and amax/8 grids for either sign of e (the baselines the search must never lose to),
# then finer and coarser steps with the extreme on the 8-level side.  Measured on the
# default model at g64 (SNR over its first 60 matrices and the embedding): this set is
# within 0.002 dB of trying both signs for divisors 7..12 at half the cost; the
# opposite-sign grids beyond 8 won under 0.5 % of the groups, divisors above 10 none.
PLAIN: tuple[float, float] = (-1.0, 8.0)
BASELINES: tuple[tuple[float, float], ...] = ((1.0, 7.0), (-1.0, 7.0), (1.0, 8.0))
SEARCH_DIVISORS: tuple[float, ...] = (7.5, 8.5, 9.0, 9.5, 10.0)

# fp32 elements per working chunk: 1 MiB per copy, so the search's few copies stay in
# cache (single thread, 49152 x 576: 1.8 s against 2.2 s with 16 MiB chunks).
DEFAULT_CHUNK_ELEMENTS = 256 << 10


@dataclass(frozen=True)
class SymGroups:
    """Rows of a matrix, quantized.  codes [R, K]; scale and sq_err [R, K / group_size]."""

    codes: torch.Tensor  # uint8, 0..15
    scale: torch.Tensor  # bfloat16, may be negative
    sq_err: torch.Tensor  # float32, sum of squared errors per group


@dataclass(frozen=True)
class RowChunk:
    """One chunk of rows [start, stop) of a matrix being quantized."""

    start: int
    stop: int
    groups: SymGroups
    signal: float  # sum of squares of the chunk's input, for the matrix's SNR


def check_shape(n: int, k: int, group_size: int) -> None:
    if group_size <= 0 or group_size % 8:
        raise ValueError(f"group size must be a positive multiple of 8, got {group_size}")
    if n <= 0 or k <= 0:
        raise ValueError(f"cannot quantize an empty matrix ({n} x {k})")
    if k % group_size:
        raise ValueError(f"K={k} is not a multiple of the group size {group_size}")


def candidates(search: bool) -> list[tuple[float, float]]:
    """(sign, divisor) pairs to try, the plain grid first (it wins ties)."""
    if not search:
        return [PLAIN]
    return [PLAIN, *BASELINES, *((-1.0, d) for d in SEARCH_DIVISORS)]


def _signed_extreme(w: torch.Tensor) -> torch.Tensor:
    """Per group [R, G]: the element of largest magnitude, with its sign."""
    idx = w.abs().argmax(dim=-1, keepdim=True)
    return w.gather(-1, idx).squeeze(-1)


def _stored_scale(extreme: torch.Tensor, sign: float, divisor: float) -> torch.Tensor:
    """The candidate scale as it will be stored (bf16), returned as fp32."""
    # divide (not multiply by 1/d) so the magnitude is the correctly rounded amax / d
    return (extreme / divisor).mul_(sign).to(SCALE_DTYPE).float()


def _codes(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Nearest code of every element on the grid `scale` (fp32 [R, G, g]).

    A zero scale (an all-zero group, or one too small for bf16) gets code 8, which
    decodes to exactly 0 whatever the scale.
    """
    safe = torch.where(scale == 0, torch.ones_like(scale), scale).unsqueeze(-1)
    q = torch.div(w, safe).round_().add_(CODE_ZERO).clamp_(0, CODE_MAX)
    return q.masked_fill_((scale == 0).unsqueeze(-1), CODE_ZERO)


def _sq_err(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (q - CODE_ZERO).mul_(scale.unsqueeze(-1)).sub_(w).square_().sum(dim=-1)


def quantize_groups(w: torch.Tensor, search: bool = False) -> SymGroups:
    """Quantize fp32 groups w [R, G, g]; per group keep the candidate with the least error.

    Returns codes shaped [R, G * g].  Only the winning scale is tracked per group and the
    codes are recomputed once at the end: keeping a [R, G, g] best-codes copy up to date
    for every candidate would double the memory traffic of the search.
    """
    w = w.float()
    extreme = _signed_extreme(w)
    if not torch.isfinite(extreme).all():  # a NaN or inf anywhere in a group shows up here
        raise ValueError("the weight contains NaN or infinite values")
    tries = candidates(search)
    best_s = best_err = q = None
    for sign, divisor in tries:
        scale = _stored_scale(extreme, sign, divisor)
        q = _codes(w, scale)
        err = _sq_err(w, q, scale)
        if best_s is None or best_err is None:
            best_s, best_err = scale, err
            continue
        better = err < best_err  # strict: ties keep the earlier candidate
        best_s = torch.where(better, scale, best_s)
        best_err = torch.where(better, err, best_err)
    assert best_s is not None and best_err is not None and q is not None
    if len(tries) > 1:
        q = _codes(w, best_s)
    r, g, size = w.shape
    codes = q.to(torch.uint8).view(r, g * size)
    return SymGroups(codes, best_s.to(SCALE_DTYPE), best_err)


def quantize_rows(
    w: torch.Tensor,
    group_size: int,
    search: bool = False,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> Iterator[RowChunk]:
    """Quantize a [N, K] matrix group-wise along K, a bounded chunk of rows at a time."""
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    check_shape(n, k, group_size)
    rows = max(1, chunk_elements // k)
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        chunk = w[start:stop].float().contiguous()
        groups = quantize_groups(chunk.view(stop - start, k // group_size, group_size), search)
        flat = chunk.view(-1)
        yield RowChunk(start, stop, groups, float(torch.dot(flat, flat)))


def dequantize(codes: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """(q - 8) * scale in fp32: codes [M, K] (any integer dtype), scale [M, K / g]."""
    m, k = codes.shape
    w = codes.to(torch.float32).view(m, k // group_size, group_size).sub_(CODE_ZERO)
    return w.mul_(scale.float().unsqueeze(-1)).view(m, k)


def snr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-noise ratio of `approx` against `reference`, in dB (inf when identical)."""
    ref = reference.double()
    return db(float(ref.square().sum()), float((approx.double() - ref).square().sum()))


def db(signal: float, noise: float) -> float:
    """10 log10(signal / noise), with the degenerate cases made explicit."""
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)
