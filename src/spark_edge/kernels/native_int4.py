"""spark-edge's C++ ops for the int4 kernel buffer, built on the host and loaded into torch.ops.spark_edge.

- `int4_linear(x, weight, scales_zeros, group)`: the cpu_int4 GEMM, whose kernel is chosen in C++ per call
  by the activation rows and the host policy set once per process (`int4_configure`, see cpu_int4_op.py):
  the int8-activation GEMM, spark-edge's own `int4_gemm` (native/int4_gemm.cpp: each 4-bit weight read from
  memory once per call whatever M), a tile GEMM, ATen's tinygemm one row at a time, or the whole weight
  dequantized and ATen's mm.
- `int4_gemm`, `int4_gemm_q8` (native/int4_gemm_q8.cpp: int8 activations per 32-K block against the 4-bit
  codes, integer dot products, for decode; `form` picks vpmaddubsw pairs or 4-byte quads, vpdpbusd with
  AVX512-VNNI and an exact stand-in without, so both forms are checked on every AVX512BW host; AVX2's layout
  has both forms too, its quads on AVX-VNNI where the CPU has it, native/int4_gemm_q8_avx2.cpp), the tile
  GEMMs over bf16 tiles of the weight in cache
  (native/bf16_tiles.h: `int4_gemm_bf16` with vdpbf16ps, `int4_gemm_amx` with AMX tiles), `int4_dequant_t`
  (native/int4_dequant.cpp: bf16 W^T [K, N] in one pass): the kernels alone.
- `int4_embedding(ids, weight, scales_zeros, group)`: rows of a quantized embedding table (tied to the head or
  not), read from its kernel buffer (native/int4_dequant.cpp), so the token lookup is one C++ call in the
  compiled graph, not a dozen torch ops.
- `int8_rows_gemm(x, codes, scale)`: w4a16's 8-bit vocabulary head on CPUs without integer dot products
  (native/int8_rows_gemm.cpp; vllm_methods/cpu_int8_table.py chooses it).

The library is compiled once per host with the C++ compiler Inductor already needs (`-march=native`,
against the running torch's headers and libraries) into the data folder, under a key of the sources, the
flags, the compiler, torch's version and the CPU's flags, so a library built on another CPU is never
loaded (a cache volume moved between hosts cannot cause an illegal instruction). `make`, `spark-edge warm`
and the image build compile it before anything serves. Where ATen runs its AVX2 kernels (an AVX2-only CPU,
`ATEN_CPU_CAPABILITY=avx2`, or qemu emulating such a CPU, whose /proc/cpuinfo still names the host's) the
library is built for the portable x86-64-v3 level instead and keyed on that, not on the CPU: every such host
loads one build (an image's), AVX-VNNI is asked at run time inside, and -march=native, which describes the
compiler's CPU, never reaches a process whose instructions are emulated. After loading, the kernels are checked against
the reference (the dequantization bit for bit, the GEMM within its stated tolerance of float64); if
there is no compiler, the build fails, or a check fails, the torch paths of cpu_int4_op.py serve and a
warning says why.

SPARK_EDGE_DISABLED_KERNELS=spark_edge_int4 turns the library off (for side-by-side benchmarks).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import logging
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from spark_edge.environment import kernel_enabled
from spark_edge.kernels.native_switch import LIBRARY, cxx_compiler
from spark_edge.paths import spark_edge_home
from spark_edge.probe.cpu_features import X86_64_V3_FLAGS, all_cpu_flags

log = logging.getLogger(__name__)
NATIVE_DIR = Path(__file__).parent / "native"
SOURCES = tuple(
    NATIVE_DIR / name
    for name in (
        "int4_ops.cpp",
        "int4_gemm.cpp",
        "int4_gemm_q8.cpp",
        "int4_gemm_q8_avx2.cpp",
        "int4_gemm_bf16.cpp",
        "int4_gemm_amx.cpp",
        "int4_dequant.cpp",
        "int8_rows_gemm.cpp",
    )
)
HEADERS = tuple(
    NATIVE_DIR / name
    for name in ("bf16.h", "bf16_tiles.h", "int4_kernels.h", "int4_q8_common.h", "int4_gemm_q8_avx2_body.h")
)
LIBRARY_NAME = "spark_edge_int4.so"
# int4_gemm_q8's forms of the integer inner product (native/int4_kernels.h); 0 is the build's own
Q8_FORMS = {"pairs": 1, "quads": 2}
NATIVE = "native"
# Portable -march levels a library may be built for, with the cpuinfo flags a host needs to run one. AVX-VNNI
# is asked at run time inside (int4_gemm_q8_avx2.cpp), so one x86-64-v3 build serves hosts with and without it.
PORTABLE_TARGETS = {"x86-64-v3": X86_64_V3_FLAGS}


def build_flags(target: str = NATIVE) -> tuple[str, ...]:
    return ("-O3", f"-march={target}", "-fopenmp", "-std=c++17", "-shared", "-fPIC")


class _Unavailable(Exception):
    pass


def _compiler() -> str:
    cxx = cxx_compiler()
    if not cxx:
        raise _Unavailable("no C++ compiler on PATH")
    return cxx


def _torch_flags() -> list[str]:
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        *(f"-I{p}" for p in cpp_extension.include_paths()),
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-L{p}" for p in cpp_extension.library_paths()),
        "-lc10",
        "-ltorch_cpu",
    ]


def _build_key(cxx: str, target: str) -> str:
    """The library's folder name: what it was compiled from and for (this CPU's flags, or a portable target)."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    cpu = (" ".join(all_cpu_flags()) or platform.processor()) if target == NATIVE else target
    parts = (
        *(s.read_bytes() for s in (*SOURCES, *HEADERS)),
        " ".join(build_flags(target)).encode(),
        version.encode(),
        torch.__version__.encode(),
        cpu.encode(),
        platform.machine().encode(),
    )
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def host_target() -> str:
    """What this process's library is built for: x86-64-v3 where ATen runs its AVX2 kernels (its layout is the
    32-channel one) and the CPU has the level's features, else this CPU (`native`)."""
    if torch.backends.cpu.get_cpu_capability() == "AVX2" and set(all_cpu_flags()).issuperset(
        PORTABLE_TARGETS["x86-64-v3"]
    ):
        return "x86-64-v3"
    return NATIVE


def _kernel_dirs() -> tuple[Path, ...]:
    """Where libraries are looked for, in order, and built into (the first writable): beside the
    environment (`make`, the image build), the data folder (an image run on another CPU), /tmp."""
    return (
        Path(sys.prefix) / "share" / "spark-edge" / "kernels",
        spark_edge_home() / "kernels",
        Path(tempfile.gettempdir()) / "spark-edge-kernels",
    )


def _writable(base: Path) -> bool:
    try:
        base.mkdir(parents=True, exist_ok=True)
        return os.access(base, os.W_OK)
    except OSError:
        return False


def build_library(target: str | None = None) -> Path:
    """The compiled library for `target` (default: this host's, host_target()), built now if missing (about
    20 s); the image build names its target."""
    cxx = _compiler()
    target = target or host_target()
    if target != NATIVE and target not in PORTABLE_TARGETS:
        raise _Unavailable(f"unknown build target {target!r} (known: {NATIVE}, {', '.join(PORTABLE_TARGETS)})")
    key = _build_key(cxx, target)
    for base in _kernel_dirs():
        if (base / key / LIBRARY_NAME).is_file():
            return base / key / LIBRARY_NAME
    base = next((b for b in _kernel_dirs() if _writable(b)), None)
    if base is None:
        raise _Unavailable("no writable folder for the compiled kernel")
    out = base / key / LIBRARY_NAME
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    cmd = [cxx, *build_flags(target), *map(str, SOURCES), "-o", str(tmp), *_torch_flags()]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise _Unavailable(f"{cxx} failed: {result.stderr.strip()[-800:]}")
    os.replace(tmp, out)  # atomic: a concurrent process sees the old name or the whole library
    return out


@functools.cache
def _load_library() -> None:
    """Load this host's library into torch.ops.spark_edge (once per process: a library is never unloaded)."""
    torch.ops.load_library(str(build_library()))
    _register_fakes()


def _register_fakes() -> None:
    """Meta implementations, so torch.compile traces the ops by shape alone."""

    @torch.library.register_fake("spark_edge::int4_linear")
    def _linear_fake(
        x: torch.Tensor, weight: torch.Tensor, scales_zeros: torch.Tensor, group_size: int
    ) -> torch.Tensor:
        return x.new_empty((x.shape[0], weight.shape[0]))

    @torch.library.register_fake("spark_edge::int4_gemm")
    def _gemm_fake(x: torch.Tensor, weight: torch.Tensor, scales_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], weight.shape[0]))

    @torch.library.register_fake("spark_edge::int4_gemm_q8")
    def _gemm_q8_fake(
        x: torch.Tensor, weight: torch.Tensor, scales_zeros: torch.Tensor, group_size: int, form: int = 0
    ) -> torch.Tensor:
        return x.new_empty((x.shape[0], weight.shape[0]))

    @torch.library.register_fake("spark_edge::int4_gemm_bf16")
    def _gemm_bf16_fake(
        x: torch.Tensor, weight: torch.Tensor, scales_zeros: torch.Tensor, group_size: int
    ) -> torch.Tensor:
        return x.new_empty((x.shape[0], weight.shape[0]))

    @torch.library.register_fake("spark_edge::int4_gemm_amx")
    def _gemm_amx_fake(
        x: torch.Tensor, weight: torch.Tensor, scales_zeros: torch.Tensor, group_size: int
    ) -> torch.Tensor:
        return x.new_empty((x.shape[0], weight.shape[0]))

    @torch.library.register_fake("spark_edge::int4_embedding")
    def _embedding_fake(
        ids: torch.Tensor, weight: torch.Tensor, scales_zeros: torch.Tensor, group_size: int
    ) -> torch.Tensor:
        return scales_zeros.new_empty((ids.shape[0], weight.shape[1] * 2))

    @torch.library.register_fake("spark_edge::int8_rows_gemm")
    def _int8_rows_fake(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], codes.shape[0]))

    @torch.library.register_fake("spark_edge::int4_dequant_t")
    def _dequant_fake(weight: torch.Tensor, scales_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
        return scales_zeros.new_empty((weight.shape[1] * 2, weight.shape[0]))


def gemm_within_tolerance(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `got` (bf16 [M, N]) is x @ weight^T to the GEMM's stated accuracy, weight being the exact
    dequantized fp32 [N, K] ((q - 8) * scale + zero, never rounded to bf16 by the kernel).

    Bound per element: half a bf16 ulp of the result (2^-9 relative, 2^-8 allowed) plus fp32 accumulation
    error, 2^-12 of sum_k |x_k w_k| (a K = 8192 dot product in fp32 stays far inside it; one misplaced
    nibble in a K = 64 row costs percents of it)."""
    reference = x.double() @ weight.double().t()
    magnitude = x.double().abs() @ weight.double().abs().t()
    return bool(torch.all((got.double() - reference).abs() <= reference.abs() * 2.0**-8 + magnitude * 2.0**-12))


def quantize_activations(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8-activation kernel's quantization, in torch: codes [M, K] and scales d [M, K / block] with
    x ~ d * codes (d = max|x| / 127 per row and block, codes = rint(x * (1 / d)) in fp32, as the C++ does)."""
    xf = x.float().reshape(x.shape[0], -1, block)
    d = xf.abs().amax(dim=2) / torch.tensor(127.0)
    inv = torch.where(d > 0, torch.tensor(1.0) / d, torch.zeros_like(d))
    codes = torch.round(xf * inv.unsqueeze(2)).clamp(-127, 127)
    return codes.reshape(x.shape), d


def gemm_q8_reference(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int
) -> torch.Tensor:
    """float64 of what int4_gemm_q8 computes: integer dots of the int8 codes and the 4-bit codes per 32-K
    block, times the block's d, then the group's scale; the zero term from the bf16 activations' sums.
    `codes` are the unsigned 4-bit codes [N, K]; scale, zero [N, K / group]."""
    xq, d = quantize_activations(x)
    m, k = x.shape
    n = codes.shape[0]
    dots = torch.einsum("mbi,nbi->mnb", xq.double().reshape(m, -1, 32), codes.double().reshape(n, -1, 32))
    scaled = (dots * d.double().unsqueeze(1)).reshape(m, n, k // group, group // 32).sum(dim=3)
    xsum = x.double().reshape(m, k // group, group).sum(dim=2)  # [M, G]
    s, z = scale.double(), zero.double()
    return (scaled * s.unsqueeze(0)).sum(dim=2) + xsum @ (z - 8 * s).t()


def int8_rows_reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float64 of what int8_rows_gemm computes: integer dots of the int8 activations and the table's codes
    [N, K] per 32-K block, times the block's d, then the row's scale [N]."""
    xq, d = quantize_activations(x)
    m, k = x.shape
    dots = torch.einsum("mbi,nbi->mnb", xq.double().reshape(m, -1, 32), codes.double().reshape(codes.shape[0], -1, 32))
    return (dots * d.double().unsqueeze(1)).sum(dim=2) * scale.double()


def gemm_q8_within_tolerance(got: torch.Tensor, reference: torch.Tensor, magnitude: torch.Tensor) -> bool:
    """The integer part is exact, so what is left is fp32 scaling and accumulation (2^-12 of the magnitude
    sum_k |x_k w_k|) and the final rounding to bf16 (2^-8 relative)."""
    return bool(torch.all((got.double() - reference).abs() <= reference.abs() * 2.0**-8 + magnitude * 2.0**-12))


def _self_check() -> None:
    """The dequantization bit-exact, the GEMMs within their tolerance of float64, on full blocks plus a
    16-channel tail (in every known layout: 80 = 64 + 16 = 2 x 32 + 16 = 5 x 16), several groups, row
    counts on both sides of the vector path's 8-row tile; the 8-bit table's GEMM on 10 passes and a tail."""
    from spark_edge.formats.int4_asym import dequantize
    from spark_edge.formats.tinygemm_layout import (
        dequantize_kernel_weight,
        detect_layout,
        kernel_codes,
        pack_for_kernel,
        scales_and_zeros,
    )

    ops = torch.ops.spark_edge
    gen = torch.Generator().manual_seed(0)
    n, k, group = 80, 128, 32
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(n, k // group, generator=gen) * 0.02 + 1e-4).to(torch.bfloat16)
    zero = (torch.randn(n, k // group, generator=gen) * 0.05).to(torch.bfloat16)
    buf, sz = pack_for_kernel(packed), scales_and_zeros(scale, zero)
    want = dequantize_kernel_weight(buf, sz, group)
    if not torch.equal(ops.int4_dequant_t(buf, sz, group).view(torch.int16), want.t().contiguous().view(torch.int16)):
        raise _Unavailable("the compiled dequantization disagrees with the reference dequantizer")
    rows = torch.tensor([0, n - 1, 17, 40, 64, 71, 33, 17])  # full blocks, both nibbles, the tail, a repeat
    if not torch.equal(ops.int4_embedding(rows, buf, sz, group).view(torch.int16), want[rows].view(torch.int16)):
        raise _Unavailable("the compiled embedding lookup disagrees with the reference dequantizer")
    x = torch.randn(11, k, generator=gen).to(torch.bfloat16)
    weight = dequantize(kernel_codes(buf), scale, zero, group)
    if not gemm_within_tolerance(ops.int4_gemm(x, buf, sz, group), x, weight):
        raise _Unavailable("the compiled int4 GEMM disagrees with the float64 reference")
    layout = detect_layout()
    tile_gemms = {
        "bf16-tile": (ops.int4_bf16_tiles_supported, ops.int4_gemm_bf16),
        "AMX tile": (ops.int4_amx_tiles_supported, ops.int4_gemm_amx),
    }
    for name, (supported, gemm) in tile_gemms.items():  # their weights are the bf16 dequantization
        if supported(layout.block, layout.halves) and not gemm_within_tolerance(
            gemm(x, buf, sz, group), x, want.float()
        ):
            raise _Unavailable(f"the compiled {name} int4 GEMM disagrees with the float64 reference")
    if ops.int4_q8_supported(64, k, group, layout.block, layout.halves):  # full blocks only
        x5, codes = x[:5], kernel_codes(buf)[:64]
        reference = gemm_q8_reference(x5, codes, scale[:64], zero[:64], group)
        magnitude = x5.double().abs() @ weight[:64].double().abs().t()
        for form in filter(ops.int4_q8_form_supported, Q8_FORMS.values()):
            got = ops.int4_gemm_q8(x5, buf[:64], sz[:, :64].contiguous(), group, form)
            if not gemm_q8_within_tolerance(got, reference, magnitude):
                raise _Unavailable(
                    f"the compiled int8-activation int4 GEMM (form {form}) disagrees with the float64 reference"
                )
    table = torch.randint(-127, 128, (n + 3, k), dtype=torch.int8, generator=gen)  # 8-channel passes and a tail
    row_scale = torch.rand(n + 3, generator=gen, dtype=torch.float32) * 0.01 + 1e-4  # vLLM may load with bf16 default
    magnitude = x.double().abs() @ (table.double().abs() * row_scale.double().unsqueeze(1)).t()
    got = ops.int8_rows_gemm(x, table, row_scale)
    if not gemm_q8_within_tolerance(got, int8_rows_reference(x, table, row_scale), magnitude):
        raise _Unavailable("the compiled 8-bit table GEMM disagrees with the float64 reference")


@functools.cache
def load_native_ops() -> bool:
    """Build (if needed), load, configure for this host's buffer layout and check the ops; False (the torch
    paths serve) with one warning saying why."""
    from spark_edge.formats.tinygemm_layout import detect_layout

    if not kernel_enabled(LIBRARY):
        return False
    try:
        _load_library()
        layout = detect_layout()
        torch.ops.spark_edge.int4_configure(layout.block, layout.halves, 0, 0, 0)  # the kernels alone, for the check
        _self_check()
        return True
    except (_Unavailable, OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("spark-edge: native int4 kernels unavailable (%s); using the slower torch paths", exc)
        return False


def native_gemm_vectorized() -> bool:
    """Whether the GEMM has its vector path for this host's buffer layout (elsewhere its portable loop is
    correct but slower than tinygemm, so it is not chosen)."""
    from spark_edge.formats.tinygemm_layout import detect_layout

    layout = detect_layout()
    return load_native_ops() and bool(torch.ops.spark_edge.int4_native_vectorized(layout.block, layout.halves))


def dequantize_kernel_weight_t(buf: torch.Tensor, sz: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """bf16 W^T [K, N] from the kernel buffer uint8 [N, K/2] and scales_and_zeros bf16 [G, N, 2], or None
    without the library."""
    return torch.ops.spark_edge.int4_dequant_t(buf, sz, group_size) if load_native_ops() else None


def main(argv: list[str]) -> int:
    """`make` and the image build: compile and check this host's library ahead of serving; `--target x86-64-v3`
    (the avx2 image) builds the portable one and checks it where ATen runs its AVX2 kernels, forced if need be."""
    parser = argparse.ArgumentParser(prog="python -m spark_edge.kernels.native_int4")
    parser.add_argument("--target", choices=tuple(PORTABLE_TARGETS), help="a portable build (default: this host's)")
    target = parser.parse_args(argv).target
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if target is not None and target != host_target():  # built and checked where ATen runs its AVX2 kernels
        env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
        return subprocess.run([sys.executable, "-m", __spec__.name], env=env, check=False).returncode
    if load_native_ops():
        print(f"spark-edge: int4 kernels ready: {build_library()}")
    else:
        print("spark-edge: int4 kernels not built here: the torch paths will serve (see the warning above)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
