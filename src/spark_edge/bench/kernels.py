"""`spark-edge bench --kernels`: the int4 GEMM kernels side by side on a model's own shapes, in one process.

For each linear shape of the model (N x K, the 4-bit tied head included) and each row count, the
time of one call of: spark-edge's native GEMM (fp32 activations), its int8-activation GEMM (decode row
counts, where the build and shape have it) in both forms of its inner product (vpmaddubsw pairs;
four-byte quads, vpdpbusd with AVX512-VNNI and an exact two-instruction stand-in without), its tile GEMMs
on tiles of the weight dequantized into cache (vdpbf16ps where the build has AVX512-BF16, AMX tiles where
the process may use them), PyTorch's tinygemm one row at a time (the previous decode path), the weight
dequantized to bf16 + oneDNN (the previous prefill path), vLLM's own 4-bit CPU GEMM `cpu_gemm_wna16` (its
GPTQ/AWQ W4A16 kernel, weights repacked as vLLM's CPUWNA16LinearKernel does; integer zero points where ours
are bf16, the same bytes per weight), vLLM's AMX W4A8 kernel `int4_scaled_mm_cpu` (what the w4a8 weight path
runs, on AMX hosts), and bf16's own GEMM on the same weight (what the bf16 weight path runs). Kernels are
interleaved round by round and the best round kept, so a noisy neighbour slows them alike. Writes a markdown
table naming the host (docs/int4-kernels.md is this table, regenerated with `spark-edge bench --kernels
--kernels-out ...`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

ROWS = (1, 2, 4, 8, 16, 64, 512)
ROUNDS = 5
TINYGEMM_MAX_ROWS = 16


def model_shapes(config: dict) -> list[tuple[str, int, int]]:
    """(name, N, K) of the linear layers of one decoder block, and the head, from a Llama-style config."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads", heads)
    return [
        ("qkv_proj", (heads + 2 * kv) * head_dim, hidden),
        ("o_proj", hidden, heads * head_dim),
        ("gate_up_proj", 2 * inter, hidden),
        ("down_proj", hidden, inter),
        ("lm_head", config["vocab_size"], hidden),
    ]


def vllm_wna16_available() -> bool:
    """Whether vLLM's CPU ops, as vLLM loads them on this host, have `cpu_gemm_wna16` (its AVX2 build has not)."""
    try:
        from vllm.platforms import current_platform

        current_platform.import_kernels()  # the build for this ISA: _C, _C_AVX512 or _C_AVX2
    except ImportError:
        return False
    return hasattr(torch.ops._C, "cpu_gemm_wna16")


def vllm_wna16(
    codes: torch.Tensor, scale: torch.Tensor, zero_points: torch.Tensor, group: int
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """x -> x @ ((codes - zero_points) * scale)^T through vLLM's `cpu_gemm_wna16`, with the weights laid out as
    vLLM's CPUWNA16LinearKernel lays them out (16-channel blocks, 8 codes per int32 along N). codes and
    zero_points uint8 [N, K] / [N, K / group], scale bf16 [N, K / group]. None where vLLM cannot take the
    shape (N or K not a multiple of 32) or this host's build of its CPU ops has no such kernel."""
    n, k = codes.shape
    if n % 32 or k % 32 or not vllm_wna16_available():
        return None
    try:
        from vllm import _custom_ops as vllm_ops
        from vllm.model_executor.kernels.linear.mixed_precision.cpu import _get_isa_hint
        from vllm.model_executor.layers.quantization.utils.quant_utils import pack_quantized_values_into_int32
        from vllm.scalar_type import scalar_types
    except ImportError:
        return None
    per_n = pack_quantized_values_into_int32(codes.t().to(torch.int32), scalar_types.uint4, 1)  # [K, N / 8]
    weight = per_n.reshape(k, -1, 2).permute(1, 0, 2).reshape(-1, k * 2).contiguous()  # 16 channels a block
    zeros = pack_quantized_values_into_int32(zero_points.t().to(torch.int32), scalar_types.uint4, 1).contiguous()
    scales = scale.t().contiguous()  # [K / group, N]
    isa = _get_isa_hint(scales.dtype)
    return lambda x: vllm_ops.cpu_gemm_wna16(
        input=x, q_weight=weight, scales=scales, zeros=zeros, bias=None, pack_factor=8, isa_hint=isa
    )


def vllm_w4a8(
    codes: torch.Tensor, scale: torch.Tensor, zero_points: torch.Tensor, group: int
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """x -> the product through vLLM's AMX W4A8 kernel `int4_scaled_mm_cpu` (activations quantized to int8 per
    row inside it: what the w4a8 weight path runs), with the weights repacked as vLLM's CPUWNA16LinearKernel
    repacks them for it (AWQ nibble order along N, then `convert_weight_packed_scale_zp`'s AMX blocks). The same
    arguments as vllm_wna16. None where the host has no AMX, vLLM's ops lack the kernel, or N or K is not a
    multiple of 32."""
    n, k = codes.shape
    if (
        n % 32
        or k % 32
        or not torch.cpu._is_amx_tile_supported()
        or not vllm_wna16_available()
        or not hasattr(torch.ops._C, "int4_scaled_mm_cpu")
    ):
        return None
    from vllm import _custom_ops as vllm_ops
    from vllm.model_executor.layers.quantization.utils.quant_utils import pack_quantized_values_into_int32
    from vllm.scalar_type import scalar_types

    def awq_packed(values: torch.Tensor) -> torch.Tensor:  # [rows, N] codes -> [rows, N / 8] in AWQ's order
        rows = values.shape[0]
        order = values.to(torch.int32).view(rows, n // 8, 8)[:, :, (0, 2, 4, 6, 1, 3, 5, 7)].reshape(rows, n)
        return pack_quantized_values_into_int32(order, scalar_types.uint4, 1).contiguous()

    weight, zeros, scales = vllm_ops.convert_weight_packed_scale_zp(
        awq_packed(codes.t()), awq_packed(zero_points.t()), scale.t().contiguous(), vllm_ops.CPUQuantAlgo.AWQ
    )
    return lambda x: vllm_ops.int4_scaled_mm_cpu(x=x, w=weight, w_zeros=zeros, w_scales=scales, bias=None)


def _time(fn: Callable[[], object], budget_s: float) -> float:
    fn()  # warm: first-touch, thread pool
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= budget_s or calls >= 200:
            return elapsed / calls


def random_kernel_weight(n: int, k: int, group: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """An N x K int4 weight of random codes, scales and zeros, in the kernels' buffer and scales_and_zeros form."""
    from spark_edge.formats import tinygemm_layout as tl

    buf = tl.pack_for_kernel(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen))
    sz = tl.scales_and_zeros(
        (torch.rand(n, k // group, generator=gen) * 0.01).to(torch.bfloat16),
        (torch.randn(n, k // group, generator=gen) * 0.01).to(torch.bfloat16),
    )
    return buf, sz


def measure(shapes: list[tuple[str, int, int]], group: int, rows: tuple[int, ...] = ROWS) -> list[dict]:
    from spark_edge.formats import tinygemm_layout as tl
    from spark_edge.kernels import cpu_int4_op
    from spark_edge.kernels import native_int4 as ni
    from spark_edge.plugin import register

    # vLLM's kernels run here as in an engine, with its plugins (runtime fixes) applied: under a forced ISA
    # torch.cpu then denies AMX, so vLLM's wna16 takes its vec form and _C_AVX2, not AMX tiles this process
    # never asked the kernel for (SIGILL)
    register()
    if not cpu_int4_op.register_ops():
        raise RuntimeError("the native int4 ops are not available on this host (see the warning above)")
    ops = torch.ops.spark_edge
    results = []
    for name, n, k in shapes:
        gen = torch.Generator().manual_seed(0)
        buf, sz = random_kernel_weight(n, k, group, gen)
        weight_t = ops.int4_dequant_t(buf, sz, group)
        vllm_weights = (
            torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen),
            (torch.rand(n, k // group, generator=gen) * 0.01).to(torch.bfloat16),
            torch.randint(0, 16, (n, k // group), dtype=torch.uint8, generator=gen),
            group,
        )
        wna16, w4a8 = vllm_wna16(*vllm_weights), vllm_w4a8(*vllm_weights)
        for m in rows:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            kernels = {
                "native": lambda: ops.int4_gemm(x, buf, sz, group),
                "tinygemm_rows": lambda: [
                    torch.ops.aten._weight_int4pack_mm_for_cpu(x[i : i + 1], buf, group, sz) for i in range(m)
                ],
                "dequant_mm": lambda: torch.mm(x, ops.int4_dequant_t(buf, sz, group)),
                "bf16_mm": lambda: torch.mm(x, weight_t),
            }
            if wna16 is not None:
                kernels["vllm_wna16"] = lambda: wna16(x)
            if w4a8 is not None:
                kernels["vllm_w4a8"] = lambda: w4a8(x)
            if cpu_int4_op.bf16_tiles_available() and m >= cpu_int4_op.TILES_MIN_ROWS:
                kernels["tiles"] = lambda: ops.int4_gemm_bf16(x, buf, sz, group)
            if cpu_int4_op.amx_tiles_available() and m >= cpu_int4_op.TILES_MIN_ROWS and k % 32 == 0:
                kernels["amx"] = lambda: ops.int4_gemm_amx(x, buf, sz, group)
            if m > TINYGEMM_MAX_ROWS:  # never run row by row at prefill sizes (seconds per call on the head)
                del kernels["tinygemm_rows"]
            layout = tl.detect_layout()
            if m <= cpu_int4_op.Q8_MAX_ROWS_VNNI and ops.int4_q8_supported(n, k, group, layout.block, layout.halves):
                for form, code in filter(lambda item: ops.int4_q8_form_supported(item[1]), ni.Q8_FORMS.items()):
                    kernels[f"q8_{form}"] = lambda code=code: ops.int4_gemm_q8(x, buf, sz, group, code)
            budget = 0.02 if m * n * k < 2**28 else 0.1
            best = dict.fromkeys(kernels, float("inf"))
            for _ in range(ROUNDS):
                for key, fn in kernels.items():
                    best[key] = min(best[key], _time(fn, budget))
            results.append(
                {"layer": name, "n": n, "k": k, "rows": m, **{f"{k_}_ms": v * 1e3 for k_, v in best.items()}}
            )
    return results


def host_line() -> str:
    from spark_edge.probe.device import host_line as device_line

    return f"{device_line()}; torch {torch.__version__}, {torch.get_num_threads()} threads"


# The table's columns in order (key in the results: key + "_ms"); a column no row has is left out (bf16 tiles
# where the build has no AVX512-BF16, AMX tiles and vLLM's W4A8 without AMX).
COLUMNS = (
    ("native", "native"),
    ("q8_pairs", "q8 pairs"),
    ("q8_quads", "q8 quads"),
    ("tiles", "bf16 tiles"),
    ("amx", "AMX tiles"),
    ("tinygemm_rows", "tinygemm rows"),
    ("dequant_mm", "dequant + mm"),
    ("vllm_wna16", "vLLM wna16"),
    ("vllm_w4a8", "vLLM w4a8"),
    ("bf16_mm", "bf16 mm"),
)
OTHERS = ("tinygemm_rows", "dequant_mm", "vllm_wna16", "vllm_w4a8", "bf16_mm")  # not spark-edge's kernels


def format_markdown(results: list[dict], model: str, group: int) -> str:
    from spark_edge.kernels import native_int4 as ni

    default = {code: form for form, code in ni.Q8_FORMS.items()}.get(torch.ops.spark_edge.int4_q8_default_form())
    columns = [(key, title) for key, title in COLUMNS if any(f"{key}_ms" in r for r in results)]
    lines = [
        f"Model: {model}, group {group}. Host: {host_line()}. int4_linear's q8 form here: {default}.",
        "",
        "| layer | N x K | rows | "
        + " | ".join(f"{title} ms" for _, title in columns)
        + " | spark-edge's best vs best other |",
        "|---|---|---:|" + "---:|" * (len(columns) + 1),
    ]
    for r in results:
        others = [r[f"{key}_ms"] for key in OTHERS if f"{key}_ms" in r]
        ours = min(r[f"{key}_ms"] for key, _ in COLUMNS if key not in OTHERS and f"{key}_ms" in r)
        cells = [f"{r[f'{key}_ms']:.3f}" if f"{key}_ms" in r else "-" for key, _ in columns]
        lines.append(
            f"| {r['layer']} | {r['n']} x {r['k']} | {r['rows']} | "
            + " | ".join(cells)
            + f" | {min(others) / ours:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def run_kernel_bench(config: dict, model: str, group: int, out: Path | None) -> str:
    table = format_markdown(measure(model_shapes(config), group), model, group)
    if out is not None:
        with out.open("a") as f:
            f.write(("\n" if out.stat().st_size else "") + table)
    return table
