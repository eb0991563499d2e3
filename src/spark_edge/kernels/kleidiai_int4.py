"""cpu_int4 linears on arm64 through KleidiAI, the int4 x int8 GEMMs in PyTorch's aarch64 wheel.

torch's `aten._dyn_quant_pack_4bit_weight` / `aten._dyn_quant_matmul_4bit` (vLLM's Dynamic4bitLinearKernel wraps
the same two ops) run KleidiAI's qai8dxp x qsi4c32p micro-kernels: the activations quantized to int8 per row
inside the call, 4-bit weights with a bf16 scale per group, NEON dot products (`sdot`) for one row and `i8mm`'s
`smmla` for more where the CPU has it. One call serves every row count, so prefill never dequantizes a matrix.

KleidiAI's 4-bit weights are symmetric, w = (q - 8) * scale; cpu_int4's carry a zero per group too,
w = (q - 8) * scale + zero. So a layer keeps the zeros beside the packed weight and adds their term:

    x @ W^T = KleidiAI(x; q, scale) + group_sums(x) @ zero^T

where group_sums(x) [M, K/g] sums x over each group's g columns: 1/g of the main product's work. The zeros stay
bf16 ([K/g, N], 0.5 bit a weight at g = 32) and are widened per call, because bf16 GEMMs are slow on arm64 CPUs
without BF16 (Cortex-A76: Raspberry Pi 5). The checkpoint's `weight_packed` (byte j = code 2j in the low nibble,
code 2j + 1 in the high) is the packer's input as it is, and its bf16 scales are KleidiAI's.

On x86 the two aten ops are PyTorch's reference code (the same arithmetic, slowly): the tests check the math
there against float64, and the kernels themselves under qemu in the arm64 image.
"""

from __future__ import annotations

import torch

from spark_edge.kernels.native_switch import kleidiai_wanted

KLEIDIAI_GROUP_MULTIPLE = 32  # KleidiAI's groupwise kernels take groups of a multiple of 32


def kleidiai_available() -> bool:
    """Whether torch runs KleidiAI's kernels here (an aarch64 build that has them, a CPU with SDOT: torch picks
    the i8mm kernel itself where the CPU has that too), and nobody disabled them. ARMv8.0 cores (Cortex-A72,
    A53) keep tinygemm rows and dequantization, as before."""
    return kleidiai_wanted() and torch.backends.kleidiai.is_available()


def kleidiai_fits(k: int, group_size: int) -> bool:
    """Whether KleidiAI's groupwise kernel takes a K x group shape (a group spanning K is its channelwise kernel,
    which wants float32 scales: not this format's)."""
    return group_size % KLEIDIAI_GROUP_MULTIPLE == 0 and k % group_size == 0 and group_size < k


def pack_weight(packed: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """uint8 [N, K/2] codes (low nibble first) and bf16 [N, K/g] scales -> KleidiAI's packed weight."""
    n, k = packed.shape[0], packed.shape[1] * 2
    return torch.ops.aten._dyn_quant_pack_4bit_weight(
        packed.contiguous(), scale.to(torch.bfloat16).contiguous(), None, group_size, k, n
    )


def zeros_term(zero: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K/g] zeros -> [K/g, N], the right-hand side of the zero term's GEMM."""
    return zero.to(torch.bfloat16).t().contiguous()


def kleidiai_linear(
    x: torch.Tensor, packed: torch.Tensor, zeros_t: torch.Tensor, group_size: int, n: int
) -> torch.Tensor:
    """bf16 [M, K] -> bf16 [M, N] = x @ ((q - 8) * scale + zero)^T, through KleidiAI plus the zero term."""
    m, k = x.shape
    xf = x.float()  # groupwise KleidiAI takes float32 activations (it quantizes them to int8 itself)
    out = torch.ops.aten._dyn_quant_matmul_4bit(xf, packed, group_size, k, n)
    sums = xf.view(m, k // group_size, group_size).sum(-1)
    return torch.addmm(out, sums, zeros_t.float()).to(torch.bfloat16)
