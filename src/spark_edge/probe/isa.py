"""The ISA levels that matter to vLLM 0.32's CPU build, as questions about a DeviceProfile.

What the wheel needs (read from vllm/platforms/cpu.py `import_kernels` and the shipped
libraries): on x86-64 it carries three kernel builds and loads one by what torch detects:
`_C` (AVX-512 with AVX512-BF16, also holding the AMX kernels), `_C_AVX512` (AVX-512 without
BF16) and `_C_AVX2`. AVX-512 is therefore not required; AVX2 is the floor, and `_C_AVX2`'s own
kernels (attention, activations) also use FMA3 and F16C instructions (checked by disassembly),
so all three are required. On aarch64 vLLM documents NEON (asimd) as its only requirement.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spark_edge.probe.device import DeviceProfile

X86_FLOOR = ("avx2", "fma", "f16c")
AVX512 = ("avx512f", "avx512bw", "avx512dq", "avx512vl")  # torch's test for its AVX-512 kernels
AMX_W4A8 = ("amx_tile", "amx_int8")  # vLLM's W4A8 kernel: int8 tile multiplies


def host_problem(profile: DeviceProfile) -> str | None:
    """Why vLLM's CPU build cannot run on this host at all, with what to do instead; None if it can."""
    if profile.machine == "x86_64":
        if profile.feature_source == "none":
            return (
                "could not read the CPU flags from /proc/cpuinfo, so spark-edge cannot tell whether "
                "vLLM's kernels (AVX2, FMA, F16C at least) will run; run it where /proc is mounted"
            )
        missing = [f for f in X86_FLOOR if f not in profile.features]
        if missing:
            return (
                f"this x86-64 CPU lacks {', '.join(missing)}; vLLM's CPU kernels need AVX2, FMA and F16C "
                "at least (Intel Haswell or AMD Zen and newer; AVX-512 recommended): run spark-edge on a "
                "newer x86-64 CPU or an arm64 CPU with NEON"
            )
        return None
    if profile.machine == "aarch64":
        if profile.feature_source == "none":
            return (
                "could not read the CPU features (neither /proc/self/auxv nor a Features line in "
                "/proc/cpuinfo), so spark-edge cannot tell whether the CPU has NEON (asimd), which "
                "vLLM's ARM kernels need; run it where /proc is mounted"
            )
        if "asimd" not in profile.features:
            return (
                "this arm64 CPU lacks Advanced SIMD (asimd, NEON), which vLLM's ARM kernels need: "
                "run spark-edge on an ARMv8-A CPU with NEON (every Cortex-A and Neoverse core has it)"
            )
        return None
    return f"this is a {profile.machine} machine; spark-edge runs on x86-64 (AVX2 or newer) and arm64 (NEON) CPUs"


def has_avx512(profile: DeviceProfile) -> bool:
    return profile.machine == "x86_64" and profile.has(*AVX512)


def amx_w4a8_ready(profile: DeviceProfile) -> bool:
    """AMX int8 tiles present and permitted: what vLLM's W4A8 kernel (int4_scaled_mm_cpu) runs on."""
    return profile.machine == "x86_64" and profile.amx_usable and profile.has(*AMX_W4A8)


def amx_missing_reason(profile: DeviceProfile) -> str:
    """Why amx_w4a8_ready is False, for messages."""
    if profile.machine != "x86_64":
        return f"AMX is an x86-64 extension and this is {profile.machine}"
    missing = [f for f in AMX_W4A8 if f not in profile.features]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    return "the CPU has AMX but the kernel did not let this process use it (arch_prctl ARCH_REQ_XCOMP_PERM refused)"


def bf16_native(profile: DeviceProfile) -> bool:
    """bf16 arithmetic in hardware; without it vLLM converts bf16 through fp32 (correct, slower)."""
    if profile.machine == "aarch64":
        return profile.has("bf16")
    return profile.has("avx512_bf16") or (profile.amx_usable and profile.has("amx_bf16"))


def isa_label(profile: DeviceProfile) -> str:
    """The host's class, as the images and `spark_edge_build_info{isa=...}` name it: amx, avx512, avx2 or arm64
    (the same tests as the images' fit, so a label never contradicts which image runs here)."""
    if profile.machine == "aarch64":
        return "arm64"
    if amx_w4a8_ready(profile) and has_avx512(profile):  # the amx image's kernels are AVX-512 ones too
        return "amx"
    return "avx512" if has_avx512(profile) else "avx2"
