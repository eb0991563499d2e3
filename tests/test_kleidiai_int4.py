"""cpu_int4 linears through KleidiAI (kernels/kleidiai_int4.py), against float64.

On x86 torch's two aten ops are its reference code, so these tests check the packing, the nibble order, the
zero term and the layer wiring on every CI host; in the arm64 image under qemu (tests/test_images.py, marker
images_arm) the same tests run KleidiAI's own NEON kernels, and the aarch64-only test says they are in use.
"""

from __future__ import annotations

import platform

import pytest
import torch
from torch._inductor import config as inductor_config

from spark_edge.environment import DISABLED_KERNELS
from spark_edge.formats import int4_asym as q4
from spark_edge.formats.cpu_int4_config import CpuInt4Settings
from spark_edge.kernels import kleidiai_int4 as kai

BF16 = torch.bfloat16
ON_ARM = platform.machine() in ("aarch64", "arm64")
# rows as the x86 kernel tests take them: decode (1-4), the q8 and tile boundaries, a prefill chunk
ROWS = (1, 2, 3, 4, 5, 8, 16, 17, 64, 512)
# (N, K, group): N tails that are not a multiple of KleidiAI's 4- and 8-channel blocks' wider tiles, groups 32-128
SHAPES = ((96, 256, 32), (80, 192, 64), (48, 512, 128), (200, 96, 32))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def _checkpoint_form(n: int, k: int, g: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A cpu_int4 layer's tensors from a random weight, and its dequantized float64 value."""
    q = q4.quantize(torch.randn(n, k) * 0.05 + 0.01, g)
    return q.packed, q.scale, q.zero, q4.dequantize_weight(q).double()


def _within_int8_activation_bound(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    """y against x @ w^T in float64, allowing what int8 activations quantized per row can cost: half a step
    (at most 2 * max|x| / 255 for symmetric or asymmetric codes) times sum |w| per output, plus y's bf16 rounding."""
    exact = x.double() @ w.t()
    step = 2 * x.double().abs().amax(dim=1, keepdim=True) / 255
    bound = 0.5 * step * w.abs().sum(dim=1) + exact.abs() * 2**-8 + 1e-6
    return bool(((y.double() - exact).abs() <= bound).all())


@pytest.mark.parametrize("n,k,g", SHAPES)
@pytest.mark.parametrize("m", ROWS)
def test_linear_matches_float64_within_int8_activation_rounding(m: int, n: int, k: int, g: int) -> None:
    packed, scale, zero, w = _checkpoint_form(n, k, g)
    x = torch.randn(m, k).to(BF16)
    y = kai.kleidiai_linear(x, kai.pack_weight(packed, scale, g), kai.zeros_term(zero), g, n)
    assert y.shape == (m, n) and y.dtype == BF16
    assert _within_int8_activation_bound(y, x, w)


def test_a_wrong_nibble_order_or_no_zero_term_fails_the_bound() -> None:
    """The bound above is tight enough to see the two mistakes this mapping could make."""
    n, k, g = 96, 256, 32
    packed, scale, zero, w = _checkpoint_form(n, k, g)
    x = torch.randn(4, k).to(BF16)
    swapped = (packed >> 4) | (packed << 4)
    y = kai.kleidiai_linear(x, kai.pack_weight(swapped, scale, g), kai.zeros_term(zero), g, n)
    assert not _within_int8_activation_bound(y, x, w)
    y = kai.kleidiai_linear(x, kai.pack_weight(packed, scale, g), kai.zeros_term(torch.zeros_like(zero)), g, n)
    assert not _within_int8_activation_bound(y, x, w)


def test_shapes_kleidiai_takes() -> None:
    assert kai.kleidiai_fits(576, 32) and kai.kleidiai_fits(1536, 64) and kai.kleidiai_fits(512, 128)
    assert not kai.kleidiai_fits(576, 576)  # a group spanning K: the channelwise kernel, float32 scales
    assert not kai.kleidiai_fits(96, 48)  # KleidiAI's groups are multiples of 32
    assert not kai.kleidiai_fits(100, 32)


def test_under_torch_compile_the_result_is_unchanged() -> None:
    """vLLM compiles the model with Inductor: the aten op and the zero term must trace and agree. Compiled as
    serve has Inductor compile (serve.import_time_env): without torch's precompiled header, which Debian 12's
    g++ 12 failed to build for SVE with bf16 here (an internal compiler error on svld1_bf16, under qemu; GCC PR
    target/123457 is the same failure in GCC 14 and 15)."""
    n, k, g = 96, 256, 32
    packed, scale, zero, w = _checkpoint_form(n, k, g)
    weight, zeros_t = kai.pack_weight(packed, scale, g), kai.zeros_term(zero)
    x = torch.randn(3, k).to(BF16)
    compiled = torch.compile(kai.kleidiai_linear, dynamic=True)
    with inductor_config.patch(cpp_cache_precompile_headers=False):
        y = compiled(x, weight, zeros_t, g, n)
    assert torch.allclose(y.float(), kai.kleidiai_linear(x, weight, zeros_t, g, n).float(), rtol=1e-2, atol=1e-3)
    assert _within_int8_activation_bound(y, x, w)


# -- the layer: which buffers it builds, and that its GEMM is right ---------------------------------------------


def _layer(n: int, k: int, g: int) -> tuple[torch.nn.Module, torch.Tensor]:
    packed, scale, zero, w = _checkpoint_form(n, k, g)
    layer = torch.nn.Module()
    for name, t in (("weight_packed", packed), ("weight_scale", scale), ("weight_zero", zero)):
        layer.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
    return layer, w


@pytest.fixture
def kleidiai_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer code's own choice, with KleidiAI reported present (on x86: torch's reference ops serve)."""
    from spark_edge.vllm_methods import cpu_int4_layers

    if not ON_ARM:
        monkeypatch.setattr(cpu_int4_layers, "kleidiai_available", lambda: True)


def test_a_linear_builds_kleidiai_buffers_and_frees_the_checkpoint_copy(kleidiai_here: None) -> None:
    from spark_edge.vllm_methods import cpu_int4_layers as layers

    n, k, g = 192, 256, 32
    layer, w = _layer(n, k, g)
    layers.build_kernel_buffers(layer, CpuInt4Settings(group_size=g))
    assert hasattr(layer, layers.KLEIDIAI_WEIGHT) and not hasattr(layer, layers.KERNEL_WEIGHT)
    assert not any(hasattr(layer, name) for name in layers.CHECKPOINT_PARAMS)
    assert getattr(layer, layers.KLEIDIAI_ZEROS).shape == (k // g, n)
    x = torch.randn(2, 5, k).to(BF16)
    bias = torch.randn(n).to(BF16)
    y = layers.apply_linear(layer, x, g, bias)
    assert y.shape == (2, 5, n)
    assert _within_int8_activation_bound((y - bias).reshape(10, n), x.reshape(10, k), w)


def test_a_table_keeps_the_buffer_its_lookup_reads(kleidiai_here: None) -> None:
    from spark_edge.vllm_methods import cpu_int4_layers as layers

    layer, _ = _layer(192, 256, 32)
    layers.build_kernel_buffers(layer, CpuInt4Settings(group_size=32), lookup=True)
    assert hasattr(layer, layers.KERNEL_WEIGHT) and not hasattr(layer, layers.KLEIDIAI_WEIGHT)


def test_kleidiai_can_be_disabled_by_name_and_the_compile_cache_stamp_says_which_ops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A graph traced with KleidiAI's ops must never load where they are off (runtime/compile_cache.py)."""
    from spark_edge.kernels import native_switch
    from spark_edge.runtime.compile_cache import cache_stamp

    monkeypatch.setenv(DISABLED_KERNELS.name, "kleidiai")
    monkeypatch.setattr(kai.torch.backends.kleidiai, "is_available", lambda: True)
    monkeypatch.setattr(native_switch.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(native_switch, "host_has_arm_dotprod", lambda: True)
    off = cache_stamp(["asimd"], "w4a16")["int4_ops"]
    assert not kai.kleidiai_available() and "kleidiai" not in off
    monkeypatch.delenv(DISABLED_KERNELS.name)
    on = cache_stamp(["asimd"], "w4a16")["int4_ops"]
    assert kai.kleidiai_available() and on == f"{off}+kleidiai"
    monkeypatch.setattr(native_switch, "host_has_arm_dotprod", lambda: False)  # ARMv8.0: no SDOT
    assert not kai.kleidiai_available()


@pytest.mark.skipif(not ON_ARM, reason="KleidiAI's kernels run on arm64 only (x86 runs torch's reference ops)")
def test_on_arm64_kleidiai_serves_the_linears() -> None:
    assert kai.kleidiai_available(), "torch's aarch64 wheel should carry KleidiAI (torch.backends.kleidiai)"
    packed, scale, _, _ = _checkpoint_form(96, 256, 32)
    assert kai.pack_weight(packed, scale, 32).dtype == torch.uint8  # KleidiAI's packing, not the reference's
