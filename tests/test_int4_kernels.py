"""spark-edge's C++ int4 ops (native_int4.py, native/*.cpp): built from this checkout, each kernel against
float64, every buffer layout the host can run, the per-host kernel choice, torch.compile, bad input."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from spark_edge.environment import DISABLED_KERNELS
from spark_edge.formats import int4_asym as q4
from spark_edge.formats import tinygemm_layout as tl
from spark_edge.kernels import cpu_int4_op
from spark_edge.kernels import native_int4 as ni
from spark_edge.probe.cpu_features import all_cpu_flags

BF16 = torch.bfloat16
ROWS = (1, 2, 3, 4, 7, 8, 15, 16, 17, 64, 512)
# (N, K): full 64-channel blocks, 16/32/48-channel tails, K of an odd number of groups
SHAPES = ((128, 256), (80, 96 * 2), (176, 384), (112, 128))


@pytest.fixture(scope="module")
def ops() -> Iterator[object]:
    if not cpu_int4_op.register_ops():
        pytest.skip("no C++ compiler here: the torch paths serve (test_cpu_int4.py)")
    yield torch.ops.spark_edge
    _configure_host()


def _configure_host() -> None:
    layout = tl.detect_layout()
    torch.ops.spark_edge.int4_configure(layout.block, layout.halves, *cpu_int4_op.host_policy())


def _pack(codes: torch.Tensor, layout: tl.KernelLayout) -> torch.Tensor:
    """Codes uint8 [N, K] -> a kernel buffer in `layout` (the inverse of tl.kernel_codes), so every layout's
    path runs on this host whatever ATen packs in."""
    n, k = codes.shape
    full = n // layout.block * layout.block
    parts = []
    for start, size, halves in [(b, layout.block, layout.halves) for b in range(0, full, layout.block)] + (
        [(full, n - full, False)] if n > full else []
    ):
        c = codes[start : start + size].t()  # [K, size]: K outer, channels inner
        lo, hi = (c[:, : size // 2], c[:, size // 2 :]) if halves else (c[:, 0::2], c[:, 1::2])
        parts.append((lo | (hi << 4)).reshape(-1))
    return torch.cat(parts).view(n, k // 2)


def _case(n: int, k: int, g: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scale = (torch.rand(n, k // g) * 0.02 + 1e-4).to(BF16)
    zero = (torch.randn(n, k // g) * 0.05).to(BF16)
    return codes, scale, zero, q4.dequantize(codes, scale, zero, g)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def test_a_fresh_checkout_builds_the_library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled from the sources in this checkout into an empty folder (what `make` does on a new host)."""
    monkeypatch.setattr(ni, "_kernel_dirs", lambda: (tmp_path / "kernels",))
    built = ni.build_library()
    assert built.is_file() and built.parent.parent == tmp_path / "kernels"
    assert ni.build_library() == built  # a second call finds it


def _kernels_ready(cmd: list[str], home: Path) -> Path:
    """`python -m spark_edge.kernels.native_int4` run as `cmd`: the library it loaded and checked."""
    env = {**os.environ, "SPARK_EDGE_HOME": str(home)}
    env.pop("ATEN_CPU_CAPABILITY", None)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    ready = re.search(r"int4 kernels ready: (\S+)", done.stdout)
    assert done.returncode == 0 and ready, done.stdout + done.stderr[-3000:]
    return Path(ready.group(1))


def test_the_portable_build_serves_where_aten_runs_avx2(tmp_path: Path) -> None:
    """The avx2 image's build (`--target x86-64-v3`) from this checkout, loaded and self-checked where ATen runs
    its AVX2 kernels (forced here): keyed on the target, not on the build host's CPU."""
    module = [sys.executable, "-m", "spark_edge.kernels.native_int4"]
    built = _kernels_ready([*module, "--target", "x86-64-v3"], tmp_path)
    assert built.parent.name == ni._build_key(ni._compiler(), "x86-64-v3")
    if ni.host_target() == ni.NATIVE:  # an AVX-512 host keeps its own build
        assert _kernels_ready(module, tmp_path).parent.name == ni._build_key(ni._compiler(), ni.NATIVE)


QEMU_X86 = shutil.which("qemu-x86_64-static") or shutil.which("qemu-x86_64")


@pytest.mark.skipif(QEMU_X86 is None, reason="no qemu-user for x86-64 (docker/start-dockerd.sh installs it)")
def test_an_emulated_avx2_cpu_loads_the_portable_build_not_the_hosts(tmp_path: Path) -> None:
    """Under qemu's Haswell (AVX2, FMA, F16C; no AVX-512, no AVX-VNNI), whose /proc/cpuinfo still names the
    host's AVX-512: the process takes the x86-64-v3 build (ATen's CPUID says AVX2), never the host's
    -march=native one, and its self-check passes: no illegal instruction, the AVX2 kernels' forms within their
    float64 tolerances."""
    module = [sys.executable, "-m", "spark_edge.kernels.native_int4"]
    portable = _kernels_ready([*module, "--target", "x86-64-v3"], tmp_path)  # compiled natively, as an image is
    emulated = _kernels_ready([QEMU_X86, "-cpu", "Haswell", *module], tmp_path)
    assert emulated == portable


@pytest.mark.parametrize("layout", tl.CANDIDATES[:3], ids=lambda c: c.name)
def test_layouts_round_trip_through_the_test_packer(layout: tl.KernelLayout) -> None:
    codes = torch.randint(0, 16, (208, 64), dtype=torch.uint8)
    assert torch.equal(tl.kernel_codes(_pack(codes, layout), layout), codes)


@pytest.mark.parametrize("g", [32, 64, 128])
@pytest.mark.parametrize("n,k", SHAPES)
def test_gemm_matches_float64_on_this_hosts_layout(ops: object, n: int, k: int, g: int) -> None:
    if k % g:
        pytest.skip("K is not a multiple of this group size")
    codes, scale, zero, exact = _case(n, k, g)
    layout = tl.detect_layout()
    buf, sz = _pack(codes, layout), tl.scales_and_zeros(scale, zero)
    assert torch.equal(buf, tl.pack_for_kernel(q4.pack_nibbles(codes)))  # the test packer is ATen's layout
    for m in ROWS:
        x = torch.randn(m, k).to(BF16)
        assert ni.gemm_within_tolerance(ops.int4_gemm(x, buf, sz, g), x, exact), (m, n, k, g)


@pytest.mark.parametrize("layout", tl.CANDIDATES[:3], ids=lambda c: c.name)
def test_gemm_every_layout_and_path(ops: object, layout: tl.KernelLayout) -> None:
    """AVX-512's and AVX2's layouts (their vector paths where the build has them) and the portable kernel's
    (portable loop)."""
    n, k, g = 208, 192, 32
    codes, scale, zero, exact = _case(n, k, g)
    buf, sz = _pack(codes, layout), tl.scales_and_zeros(scale, zero)
    ops.int4_configure(layout.block, layout.halves, 0, -1, 0)
    try:
        for m in ROWS:
            x = torch.randn(m, k).to(BF16)
            assert ni.gemm_within_tolerance(ops.int4_gemm(x, buf, sz, g), x, exact), (m, layout)
        # the dequantization and the embedding lookup read the same layout, bit-exact
        assert torch.equal(ops.int4_dequant_t(buf, sz, g).t(), exact.to(BF16))
        ids = torch.tensor([0, 1, 31, 32, 63, 64, 127, 191, 192, 200, 207, 5, 5])  # both nibbles, blocks, the tail
        for dtype in (torch.int64, torch.int32):
            assert torch.equal(ops.int4_embedding(ids.to(dtype), buf, sz, g), exact.to(BF16)[ids]), (dtype, layout)
        assert ops.int4_embedding(ids[:0], buf, sz, g).shape == (0, k)
    finally:
        _configure_host()


def test_embedding_is_the_lookup_the_torch_path_makes(ops: object) -> None:
    """The C++ lookup a model's quantized table takes equals the torch op it replaced (gather_kernel_rows), on
    this host's layout, with a 16-channel tail and every group size."""
    n, k = 80, 256
    for g in (32, 64, 128):
        codes, scale, zero, _ = _case(n, k, g)
        buf, sz = _pack(codes, tl.detect_layout()), tl.scales_and_zeros(scale, zero)
        ids = torch.randint(0, n, (37,))
        assert torch.equal(ops.int4_embedding(ids, buf, sz, g), tl.gather_kernel_rows(buf, sz, ids, g)), g


def test_gemm_integer_codes_are_accumulated_exactly(ops: object) -> None:
    """Scale 1, zero 8 and integer activations: every product and sum is an integer below 2^24, so fp32
    accumulation is exact and the result is the exact integer dot product (up to bf16 rounding)."""
    n, k, g = 192, 256, 32
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scale, zero = torch.ones(n, k // g, dtype=BF16), torch.full((n, k // g), 8.0, dtype=BF16)
    buf, sz = tl.pack_for_kernel(q4.pack_nibbles(codes)), tl.scales_and_zeros(scale, zero)
    for m in (1, 3, 9):
        x = torch.randint(-4, 5, (m, k)).to(BF16)
        exact = (x.double() @ codes.double().t()).to(BF16)
        assert torch.equal(ops.int4_gemm(x, buf, sz, g), exact)


def test_host_policy_and_kernel_choice(ops: object, monkeypatch: pytest.MonkeyPatch) -> None:
    policy = cpu_int4_op.host_policy()
    amx = cpu_int4_op.host_has_bf16_gemm() and cpu_int4_op.amx_tiles_available()
    tiles = (
        cpu_int4_op.host_has_bf16_gemm() and not cpu_int4_op.host_has_amx_bf16() and cpu_int4_op.bf16_tiles_available()
    )
    if ni.native_gemm_vectorized():
        assert policy.q8_max_rows == min(cpu_int4_op.q8_max_rows(), cpu_int4_op.AMX_MIN_ROWS - 1 if amx else 16)
        assert policy.tiles == cpu_int4_op.TILES["amx" if amx else "tiles" if tiles else "none"]
        if amx:  # AMX usable by this process (Sapphire Rapids and later): AMX tiles above the int8 kernel's rows
            assert policy.native_max_rows == cpu_int4_op.AMX_MIN_ROWS - 1
            assert [cpu_int4_op.kernel_for(m, 128, 256) for m in (16, 17, 512)] == ["q8", "amx", "amx"]
            assert cpu_int4_op.kernel_for(512, 128, 272) == "tiles"  # K not a multiple of AMX's 32-step rows
            monkeypatch.setenv(DISABLED_KERNELS.name, "int4_gemm_amx")  # AMX hosts never take the bf16 tiles
            assert cpu_int4_op.kernel_for(512, 128, 256) == "dequant"
            monkeypatch.delenv(DISABLED_KERNELS.name)
        elif tiles:  # AVX512-BF16 without AMX (Zen 4, Cooper Lake): the tiles from 8 rows on
            assert policy.native_max_rows == cpu_int4_op.TILES_MIN_ROWS - 1
            assert [cpu_int4_op.kernel_for(m, 80, 256) for m in (4, 7, 8, 512)] == [
                "native",
                "native",
                "tiles",
                "tiles",
            ]
            assert [cpu_int4_op.kernel_for(m, 128, 256) for m in (policy.q8_max_rows, 512)] == ["q8", "tiles"]
            monkeypatch.setenv(DISABLED_KERNELS.name, "int4_gemm_bf16")
            assert cpu_int4_op.kernel_for(512, 128, 256) == "dequant"
            monkeypatch.delenv(DISABLED_KERNELS.name)
        else:
            assert policy.native_max_rows == (
                cpu_int4_op.NATIVE_MAX_ROWS_BF16_HOST if cpu_int4_op.host_has_bf16_gemm() else -1
            )
        assert cpu_int4_op.kernel_for(1, 64, 64) == cpu_int4_op.kernel_for(policy.q8_max_rows, 128, 256) == "q8"
        assert cpu_int4_op.kernel_for(1, 80, 64) == "native"  # a 16-channel tail: no int8 kernel for it
        monkeypatch.setenv(DISABLED_KERNELS.name, "int4_gemm_q8")
        assert cpu_int4_op.host_policy().q8_max_rows == 0 and cpu_int4_op.kernel_for(1, 64, 64) == "native"
        monkeypatch.delenv(DISABLED_KERNELS.name)
    else:
        assert policy.q8_max_rows == policy.native_max_rows == 0 and cpu_int4_op.kernel_for(1) == "tinygemm"
    # other hosts' policies, through the C++ op's own dispatch: a tile GEMM this build or process cannot run
    # is passed over there (what a Python mirror of the dispatch once missed)
    vdp = "tiles" if cpu_int4_op.bf16_tiles_available() else None
    amx_tiles = "amx" if cpu_int4_op.amx_tiles_available() else vdp
    bf16_host = cpu_int4_op.KernelPolicy(0, 16, 8)  # a bf16 host without the tiles, int8 kernel off
    monkeypatch.setattr(cpu_int4_op, "host_policy", lambda: bf16_host)
    assert [cpu_int4_op.kernel_for(m) for m in (1, 16, 17, 512)] == ["native", "native", "dequant", "dequant"]
    monkeypatch.setattr(cpu_int4_op, "host_policy", lambda: cpu_int4_op.KernelPolicy(0, 7, 8, 1))
    assert [cpu_int4_op.kernel_for(m) for m in (7, 8, 512)] == ["native", vdp or "tinygemm", vdp or "dequant"]
    monkeypatch.setattr(cpu_int4_op, "host_policy", lambda: cpu_int4_op.KernelPolicy(0, 16, 8, 2))
    assert [cpu_int4_op.kernel_for(m) for m in (16, 17, 512)] == [
        "native",
        amx_tiles or "dequant",
        amx_tiles or "dequant",
    ]
    monkeypatch.setattr(cpu_int4_op, "host_policy", lambda: cpu_int4_op.KernelPolicy(0, 0, 8))  # no vector path
    assert [cpu_int4_op.kernel_for(m) for m in (1, 8, 9)] == ["tinygemm", "tinygemm", "dequant"]


@pytest.mark.parametrize(
    "policy",
    [(0, -1, 0), (0, 16, 8), (0, 0, 8), (0, 0, 0), (0, 4, 8, 1), (0, 4, 8, 2)],
    ids=["native", "bf16-host", "tinygemm", "dequant", "tiles", "amx"],
)
def test_int4_linear_agrees_whichever_kernel_serves(ops: object, policy: tuple) -> None:
    if len(policy) > 3:
        _tiles_or_skip(ops, "amx" if policy[3] == cpu_int4_op.TILES["amx"] else "tiles")
    layout = tl.detect_layout()
    n, k, g = 576, 256, 32
    codes, scale, zero, exact = _case(n, k, g)
    buf, sz = tl.pack_for_kernel(q4.pack_nibbles(codes)), tl.scales_and_zeros(scale, zero)
    ops.int4_configure(layout.block, layout.halves, *policy)
    try:
        for m in (1, 4, 8, 9, 16, 40):
            x = torch.randn(m, k).to(BF16)
            y = ops.int4_linear(x, buf, sz, g)
            assert y.shape == (m, n) and y.dtype == BF16
            # tinygemm and oneDNN round the weight or the products to bf16 on the way: an SNR bound for all
            assert q4.snr_db(x.double() @ exact.double().t(), y.double()) > 40, (policy, m)
        assert ops.int4_linear(torch.randn(0, k).to(BF16), buf, sz, g).shape == (0, n)
    finally:
        _configure_host()


# The tile GEMMs (bf16_tiles.h): (whether this build and process have it, the kernel, why it may be missing)
TILE_GEMMS = {
    "tiles": ("int4_bf16_tiles_supported", "int4_gemm_bf16", "it needs AVX512-BF16 and ATen's AVX-512 layout"),
    "amx": (
        "int4_amx_tiles_supported",
        "int4_gemm_amx",
        "it needs AMX-BF16, ATen's AVX-512 layout and the kernel's permission to use AMX tiles",
    ),
}


def _tiles_or_skip(ops: object, name: str) -> object:
    """The tile GEMM `name` of TILE_GEMMS, or a skip saying why this host has none."""
    supported, gemm, why = TILE_GEMMS[name]
    layout = tl.detect_layout()
    if not getattr(ops, supported)(layout.block, layout.halves):
        pytest.skip(f"no {gemm} in this build or process ({why})")
    return getattr(ops, gemm)


@pytest.mark.parametrize("tiles", sorted(TILE_GEMMS))
@pytest.mark.parametrize("g", [32, 64, 128])
@pytest.mark.parametrize("n,k", SHAPES + ((128, 1536), (80, 1088)))  # + K over several 512-step tiles, one ragged
def test_gemm_tiles_match_float64(ops: object, n: int, k: int, g: int, tiles: str) -> None:
    """A tile kernel's weights are the bf16 dequantization (int4_dequant_t's values, bit for bit the weights
    dequant + oneDNN multiplies), so against those in float64 the bound is the fp32-accumulation one of
    gemm_within_tolerance; against the exact weights it is bf16's rounding of a weight, 2^-9 relative. The rows
    take every AMX configuration: one A tile (<= 16 rows), two (17-32), 32-row chunks and a ragged last one."""
    gemm = _tiles_or_skip(ops, tiles)
    if k % g:
        pytest.skip("K is not a multiple of this group size")
    codes, scale, zero, exact = _case(n, k, g)
    buf, sz = tl.pack_for_kernel(q4.pack_nibbles(codes)), tl.scales_and_zeros(scale, zero)
    weight_bf16 = ops.int4_dequant_t(buf, sz, g).t().float()
    for m in ROWS + (33, 47):
        x = torch.randn(m, k).to(BF16)
        got = gemm(x, buf, sz, g)
        assert got.shape == (m, n) and ni.gemm_within_tolerance(got, x, weight_bf16), (m, n, k, g)
        full = x.double() @ exact.double().t()
        assert (got.double() - full).norm() <= 2.0**-8 * full.norm(), (m, n, k, g)


@pytest.mark.parametrize("tiles", sorted(TILE_GEMMS))
def test_gemm_tiles_integer_products_are_exact(ops: object, tiles: str) -> None:
    """Scale 1, zero 8 (weights = codes - 8 + 8, exact in bf16) and small integer activations: every product
    and partial sum is an integer below 2^24, so the result is the exact dot product up to its bf16 rounding."""
    gemm = _tiles_or_skip(ops, tiles)
    n, k, g = 208, 1280, 64
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scale, zero = torch.ones(n, k // g, dtype=BF16), torch.full((n, k // g), 8.0, dtype=BF16)
    buf, sz = tl.pack_for_kernel(q4.pack_nibbles(codes)), tl.scales_and_zeros(scale, zero)
    for m in (1, 6, 7, 17, 40):
        x = torch.randint(-4, 5, (m, k)).to(BF16)
        assert torch.equal(gemm(x, buf, sz, g), (x.double() @ codes.double().t()).to(BF16)), m


def test_gemm_amx_leaves_the_tile_state_to_the_next_amx_kernel(ops: object) -> None:
    """AMX tile state is per thread: the AMX GEMM loads its configuration and releases the tiles on every thread
    it ran on, so oneDNN's AMX bf16 GEMM (torch.mm on this host) and the AMX GEMM interleaved over many calls,
    with row counts that take different tile configurations (one A tile, two, a ragged chunk), keep their
    results: the first call's, bit for bit."""
    gemm = _tiles_or_skip(ops, "amx")
    n, k, g = 192, 512, 32
    codes, scale, zero, _ = _case(n, k, g)
    buf, sz = tl.pack_for_kernel(q4.pack_nibbles(codes)), tl.scales_and_zeros(scale, zero)
    weight_t = ops.int4_dequant_t(buf, sz, g)
    xs = [torch.randn(m, k).to(BF16) for m in (17, 5, 40, 64)]
    want = [(gemm(x, buf, sz, g), torch.mm(x, weight_t)) for x in xs]
    for _ in range(25):
        for x, (ours, onednn) in zip(xs, want):
            assert torch.equal(gemm(x, buf, sz, g), ours)
            assert torch.equal(torch.mm(x, weight_t), onednn)


Q8_SHAPES = ((64, 64), (128, 256), (192, 384), (576, 576))


def _q8_or_skip(ops: object, n: int, k: int, g: int, layout: tl.KernelLayout, form: str = "pairs") -> None:
    """Skip unless the build has the int8-activation kernel for this shape and layout (AVX512BW: ATen's 64-channel
    AVX-512 layout; AVX2: its 32-channel layout; pairs and quads on both), with `layout` configured."""
    if not ops.int4_q8_supported(n, k, g, layout.block, layout.halves):
        pytest.skip(f"no int8-activation kernel in this build for {layout.name}")
    ops.int4_configure(layout.block, layout.halves, 0, -1, 0)
    if not ops.int4_q8_form_supported(ni.Q8_FORMS[form]):
        pytest.skip(f"no {form} form for {layout.name}")


# ATen's AVX-512 and AVX2 layouts: each kernel runs wherever the build has it, on buffers packed by the test
Q8_LAYOUTS = tl.CANDIDATES[:2]


@pytest.mark.parametrize("layout", Q8_LAYOUTS, ids=lambda c: f"{c.block}ch")
@pytest.mark.parametrize("form", sorted(ni.Q8_FORMS))
@pytest.mark.parametrize("g", [32, 64, 128])
@pytest.mark.parametrize("n,k", Q8_SHAPES)
def test_gemm_q8_matches_its_float64_reference(
    ops: object, n: int, k: int, g: int, form: str, layout: tl.KernelLayout
) -> None:
    """Integer dots of the int8 activations and 4-bit codes are exact; what is left is fp32 scaling (2^-12 of
    sum |x w|) and the bf16 result (2^-8 relative). Against the exact product, the int8 activations cost
    about 1% of the result's norm. Each layout's kernel and each form of the inner product in turn (quads:
    vpdpbusd with VNNI, its stand-in without)."""
    if k % g:
        pytest.skip("K is not a multiple of this group size")
    _q8_or_skip(ops, n, k, g, layout, form)
    try:
        codes, scale, zero, exact = _case(n, k, g)
        buf, sz = _pack(codes, layout), tl.scales_and_zeros(scale, zero)
        for m in ROWS:
            x = torch.randn(m, k).to(BF16)
            got = ops.int4_gemm_q8(x, buf, sz, g, ni.Q8_FORMS[form])
            magnitude = x.double().abs() @ exact.double().abs().t()
            reference = ni.gemm_q8_reference(x, codes, scale, zero, g)
            assert ni.gemm_q8_within_tolerance(got, reference, magnitude), (m, n, k)
            full = x.double() @ exact.double().t()
            assert (got.double() - full).norm() <= 0.03 * full.norm(), (m, n, k, g)
    finally:
        _configure_host()


@pytest.mark.parametrize("layout", Q8_LAYOUTS, ids=lambda c: f"{c.block}ch")
@pytest.mark.parametrize("form", sorted(ni.Q8_FORMS))
def test_gemm_q8_integer_accumulation_is_exact(ops: object, form: str, layout: tl.KernelLayout) -> None:
    """Activations whose int8 quantization is exact (integers, 127 in every 32-block), scale 1, zero 8: the
    result is the exact integer dot product, up to its rounding to bf16."""
    n, k, g = 128, 256, 64
    _q8_or_skip(ops, n, k, g, layout, form)
    try:
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        scale, zero = torch.ones(n, k // g, dtype=BF16), torch.full((n, k // g), 8.0, dtype=BF16)
        buf, sz = _pack(codes, layout), tl.scales_and_zeros(scale, zero)
        for m in (1, 3, 5, 16):
            x = torch.randint(-127, 128, (m, k))
            x[:, ::32] = 127  # d = 1 in every block
            x = x.to(BF16)
            exact = (x.double() @ codes.double().t()).to(BF16)
            assert torch.equal(ops.int4_gemm_q8(x, buf, sz, g, ni.Q8_FORMS[form]), exact)
    finally:
        _configure_host()


@pytest.mark.parametrize("n,k", [(64, 576), (83, 96), (8, 2048), (5, 64)])
def test_int8_rows_gemm_matches_its_float64_reference(ops: object, n: int, k: int) -> None:
    """The 8-bit table's head: integer dots per 32-K block exact, fp32 scaling and the bf16 result within the
    int4 decode kernel's bounds, for every row count; 8-channel passes, a tail of 3 and a table under 8 rows."""
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scale = torch.rand(n) * 0.01 + 1e-4
    exact = codes.double() * scale.double().unsqueeze(1)
    for m in ROWS:
        x = torch.randn(m, k).to(BF16)
        got = ops.int8_rows_gemm(x, codes, scale)
        assert got.shape == (m, n) and got.dtype == BF16
        magnitude = x.double().abs() @ exact.abs().t()
        assert ni.gemm_q8_within_tolerance(got, ni.int8_rows_reference(x, codes, scale), magnitude), (m, n, k)
        full = x.double() @ exact.t()
        assert (got.double() - full).norm() <= 0.03 * full.norm(), (m, n, k)


def test_int8_rows_gemm_integer_accumulation_is_exact(ops: object) -> None:
    """Codes at both ends of [-127, 127] against activations whose int8 quantization is exact (127 in every
    32-block): the integer dot product itself, up to its rounding to bf16 (no int16 pair saturates)."""
    n, k = 40, 256
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    codes[:8] = torch.tensor([127, -127], dtype=torch.int8).repeat(k // 2)
    for m in (1, 3, 16):
        x = torch.randint(-127, 128, (m, k))
        x[:, ::32] = 127
        x[0, 1::2] = -127  # with codes[:8]: every pair at its extreme
        x = x.to(BF16)
        exact = (x.double() @ codes.double().t()).to(BF16)
        assert torch.equal(ops.int8_rows_gemm(x, codes, torch.ones(n)), exact)


def test_the_self_check_holds_under_the_default_dtype_vllm_loads_with(ops: object) -> None:
    """vLLM builds the model, and so first loads the library, with torch's default dtype set to the model's
    (bf16): a check tensor made without a dtype turned bf16 there and the whole library was refused."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(BF16)
    try:
        ni._self_check()
    finally:
        torch.set_default_dtype(previous)
        _configure_host()


def test_int8_rows_gemm_refuses_what_it_cannot_take(ops: object) -> None:
    x, codes, scale = torch.randn(2, 64).to(BF16), torch.zeros(16, 64, dtype=torch.int8), torch.ones(16)
    assert ops.int8_rows_gemm(x[:0], codes, scale).shape == (0, 16)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.int8_rows_gemm(torch.randn(2, 48).to(BF16), torch.zeros(16, 48, dtype=torch.int8), scale)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.int8_rows_gemm(x.float(), codes, scale)
    with pytest.raises(RuntimeError, match="K must match"):
        ops.int8_rows_gemm(x, codes[:, :32].contiguous(), scale)


def test_int4_linear_takes_the_q8_kernel_for_decode_rows(ops: object) -> None:
    layout = tl.detect_layout()
    n, k, g = 576, 256, 32
    _q8_or_skip(ops, n, k, g, layout)
    codes, scale, zero, exact = _case(n, k, g)
    buf, sz = tl.pack_for_kernel(q4.pack_nibbles(codes)), tl.scales_and_zeros(scale, zero)
    # the layout's form: vpdpbusd quads on the 64-channel layout where the compiler targets AVX512-VNNI
    # (-march=native), on the 32-channel one where the CPU has AVX-VNNI (asked at run time), pairs elsewhere
    flags = all_cpu_flags()
    quads = ("avx512_vnni" in flags and layout.block == 64) or ("avx_vnni" in flags and layout.block == 32)
    assert ops.int4_q8_default_form() == ni.Q8_FORMS["quads" if quads else "pairs"]
    ops.int4_configure(layout.block, layout.halves, 16, -1, 0)
    try:
        for m in (1, 7, 16, 17):
            x = torch.randn(m, k).to(BF16)
            default = ops.int4_q8_default_form()
            want = ops.int4_gemm_q8(x, buf, sz, g, default) if m <= 16 else ops.int4_gemm(x, buf, sz, g)
            assert torch.equal(ops.int4_linear(x, buf, sz, g), want), m
    finally:
        _configure_host()


def test_int4_linear_under_torch_compile(ops: object) -> None:
    """The fake implementation lets dynamo trace the op by shape: one opaque call for every M."""
    buf = tl.pack_for_kernel(torch.randint(0, 256, (64, 32), dtype=torch.uint8))
    sz = tl.scales_and_zeros(torch.full((64, 2), 0.01, dtype=BF16), torch.zeros(64, 2, dtype=BF16))

    def f(x: torch.Tensor) -> torch.Tensor:
        return ops.int4_linear(x, buf, sz, 32) * 2

    compiled = torch.compile(f, backend="eager", dynamic=True, fullgraph=True)
    for rows in (1, 5, 33):
        x = torch.randn(rows, 64).to(BF16)
        assert torch.equal(compiled(x), f(x))


def test_bad_input_is_a_clear_error_not_a_crash(ops: object) -> None:
    n, k, g = 64, 128, 32
    buf = torch.zeros(n, k // 2, dtype=torch.uint8)
    sz = torch.zeros(k // g, n, 2, dtype=BF16)
    x = torch.randn(2, k).to(BF16)
    cases = {
        "bfloat16": (x.float(), buf, sz, g),
        "does not match the weight": (torch.randn(2, k + 32).to(BF16), buf, sz, g),
        "scales_zeros": (x, buf, torch.zeros(k // g, n + 16, 2, dtype=BF16), g),
        "group size": (x, buf, sz, 48),
        "uint8": (x, buf.to(torch.int32), sz, g),
    }
    layout = tl.detect_layout()
    tiles = tuple(
        getattr(ops, gemm)
        for supported, gemm, _ in TILE_GEMMS.values()
        if getattr(ops, supported)(layout.block, layout.halves)
    )
    for message, args in cases.items():
        for op in (ops.int4_linear, ops.int4_gemm, ops.int4_gemm_q8, *tiles):
            with pytest.raises(RuntimeError, match=message):
                op(*args)
    if ops.int4_q8_supported(n, k, g, tl.detect_layout().block, tl.detect_layout().halves):
        with pytest.raises(RuntimeError, match="form must be"):
            ops.int4_gemm_q8(x, buf, sz, g, 3)
    for ids, message in (
        (torch.tensor([3, n]), f"token id {n} is outside the table's {n} rows"),
        (torch.tensor([-1]), "token id -1 is outside"),
        (torch.tensor([[1]]), "1-D int32 or int64"),
        (torch.tensor([1.0]), "1-D int32 or int64"),
    ):
        with pytest.raises(RuntimeError, match=message):
            ops.int4_embedding(ids, buf, sz, g)
    with pytest.raises(RuntimeError, match="does not match"):  # the table's scales for another group size
        ops.int4_embedding(torch.tensor([1]), buf, sz, 64)
    with pytest.raises(RuntimeError, match="no int8-activation kernel"):  # a 16-channel tail
        ops.int4_gemm_q8(x, torch.zeros(80, k // 2, dtype=torch.uint8), torch.zeros(k // g, 80, 2, dtype=BF16), g)


def test_kernel_bench_times_every_kernel_on_a_correct_product(ops: object) -> None:
    """`bench --kernels`: vLLM's cpu_gemm_wna16, set up as vLLM lays its weights out, computes the product it
    is timed for (bf16 weights and result: within 1%), and a tiny run fills every column of the table."""
    from spark_edge.bench import kernels

    n, k, g = 96, 256, 32
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scale = (torch.rand(n, k // g) * 0.02 + 1e-3).to(BF16)
    zero_points = torch.randint(0, 16, (n, k // g), dtype=torch.uint8)
    weight = (codes.double() - zero_points.double().repeat_interleave(g, 1)) * scale.double().repeat_interleave(g, 1)
    wna16 = kernels.vllm_wna16(codes, scale, zero_points, g)
    has_wna16 = kernels.vllm_wna16_available()  # not in vLLM's AVX2 build of its CPU ops
    assert (wna16 is not None) == has_wna16
    assert kernels.vllm_wna16(codes[:80], scale[:80], zero_points[:80], g) is None  # N % 32
    for m in (1, 3, 17) if wna16 is not None else ():
        x = torch.randn(m, k).to(BF16)
        reference = x.double() @ weight.t()
        assert (wna16(x).double() - reference).norm() <= 0.01 * reference.norm(), m
    w4a8 = kernels.vllm_w4a8(codes, scale, zero_points, g)  # vLLM's AMX W4A8 kernel: AMX hosts only
    assert (w4a8 is not None) == (has_wna16 and torch.cpu._is_amx_tile_supported())
    for m in (1, 3, 17) if w4a8 is not None else ():  # int8 activations: ~1% of the result's norm
        x = torch.randn(m, k).to(BF16)
        reference = x.double() @ weight.t()
        assert (w4a8(x).double() - reference).norm() <= 0.03 * reference.norm(), m
    results = kernels.measure([("o_proj", 64, 64)], 32, rows=(1, 64))
    assert [r["rows"] for r in results] == [1, 64]
    assert {"native_ms", "dequant_mm_ms", "bf16_mm_ms"} <= set(results[1])
    assert ("vllm_wna16_ms" in results[1]) == has_wna16 and ("vllm_w4a8_ms" in results[1]) == (w4a8 is not None)
    assert ("amx_ms" in results[1]) == cpu_int4_op.amx_tiles_available()
    assert "tinygemm_rows_ms" in results[0] and "tinygemm_rows_ms" not in results[1]
    table = kernels.format_markdown(results, "tiny", 32)
    if ops.int4_q8_supported(64, 64, 32, tl.detect_layout().block, tl.detect_layout().halves):
        forms = {f"q8_{form}_ms" for form, code in ni.Q8_FORMS.items() if ops.int4_q8_form_supported(code)}
        assert "q8_pairs_ms" in forms and forms <= set(results[0]) and "q8_pairs_ms" not in results[1]
    assert table.count("| o_proj | 64 x 64 |") == 2 and ("vLLM wna16 ms" in table) == has_wna16
