"""Which instruction-set extensions the CPU offers: x86 cpuinfo flags, ARM hardware capabilities.

The architecture itself is never read from here: under qemu-user emulation /proc/cpuinfo
describes the host, not the emulated process (see device.py).

On ARM the kernel's hardware capability bits (AT_HWCAP, AT_HWCAP2 in /proc/self/auxv) are the
authoritative answer; the cpuinfo "Features" line is printed from the same bits and serves as the
fallback when auxv cannot be read. Names keep the kernel's cpuinfo spellings everywhere.
"""

from __future__ import annotations

import functools
import platform
import struct
from dataclasses import dataclass
from pathlib import Path

from spark_edge.environment import forced_isa
from spark_edge.probe.procfs import read_bytes, read_text
from spark_edge.probe.x86_cpuid import cpuid_features

# x86 flags that decide which vLLM kernels and weight paths run (kernel spellings).
X86_FEATURES = (
    "avx2",
    "fma",
    "f16c",  # vLLM's _C_AVX2 kernels use all three
    "avx512f",
    "avx512bw",
    "avx512dq",
    "avx512vl",  # the set torch and vLLM call "AVX-512"
    "avx512_bf16",
    "avx512_vnni",
    "avx_vnni",  # VEX-encoded vpdpbusd on AVX2 cores (Alder Lake and later, N100)
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)

# The cpuinfo flags of the psABI's x86-64-v3 level: AVX2, FMA, F16C, BMI1/2, LZCNT (`abm`), MOVBE over v2's
# SSE4.2, SSSE3, POPCNT (a portable build's target, kernels/native_int4.py)
X86_64_V3_FLAGS = ("avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe", "xsave", "popcnt", "sse4_2", "ssse3")
# The x86 flags of the CPU class a forced ISA stands for (SPARK_EDGE_FORCED_ISA): an AVX2 desktop or embedded
# core, AVX-VNNI kept where this CPU has it (Alder Lake and later, N100)
FORCED_ISA_FLAGS = {"avx2": frozenset({*X86_64_V3_FLAGS, "avx_vnni"})}

# ARM features, named as in /proc/cpuinfo, with their Linux arm64 hwcap bits
# (arch/arm64/include/uapi/asm/hwcap.h).
AT_HWCAP = 16
AT_HWCAP2 = 26
ARM_HWCAP_BITS = {
    "asimd": (AT_HWCAP, 1 << 1),  # HWCAP_ASIMD: Advanced SIMD (NEON)
    "asimddp": (AT_HWCAP, 1 << 20),  # HWCAP_ASIMDDP: int8 dot product (SDOT/UDOT)
    "sve": (AT_HWCAP, 1 << 22),  # HWCAP_SVE
    "sve2": (AT_HWCAP2, 1 << 1),  # HWCAP2_SVE2
    "i8mm": (AT_HWCAP2, 1 << 13),  # HWCAP2_I8MM: int8 matrix multiply
    "bf16": (AT_HWCAP2, 1 << 14),  # HWCAP2_BF16: BFloat16 arithmetic
}
ARM_FEATURES = tuple(ARM_HWCAP_BITS)

# Features with which oneDNN runs bf16 GEMMs in bf16 hardware (x86 flags, the arm64 hwcap name); without
# them it converts to fp32 itself: slower, and it holds more memory (planning/memory_plan.py).
BF16_GEMM_FEATURES = frozenset({"avx512_bf16", "amx_bf16", "bf16"})

# Features with which int8 GEMMs have integer dot products (vpdpbusd, AMX): without them oneDNN's int8 matmul
# runs vpmaddubsw code that saturates int16 pairs and crawls (a 49152 x 576 int8 head on an AMD EPYC Zen 3,
# AVX2 only: 22.7 ms a row at 35 dB SNR, against 2.5 ms at 52 dB for PyTorch's int8 x bf16 kernel)
INT8_DOT_FEATURES = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})
PACKED_INT8_FEATURES = frozenset({"avx512_vnni", "avx512bw", "avx512vl"})

# Arm Ltd. (implementer 0x41) part numbers of cores spark-edge expects to meet; others print as hex.
ARM_PARTS = {
    0xD03: "Cortex-A53",
    0xD08: "Cortex-A72",
    0xD0B: "Cortex-A76",
    0xD0C: "Neoverse-N1",
    0xD40: "Neoverse-V1",
    0xD49: "Neoverse-N2",
    0xD4F: "Neoverse-V2",
}


@dataclass(frozen=True)
class CpuFeatures:
    names: frozenset[str]
    source: str  # "cpuinfo flags" [and "cpuid"], "cpuid", "auxv", "cpuinfo Features", or "none" (nothing readable)
    model: str | None


def probe_cpu_features(root: Path, machine: str) -> CpuFeatures:
    cpuinfo = read_text(root, "proc/cpuinfo") or ""
    fields = first_processor_fields(cpuinfo)
    if machine == "x86_64":
        return _x86_features(root, fields)
    if machine == "aarch64":
        model = _arm_model(fields)
        hwcaps = read_auxv_hwcaps(read_bytes(root, "proc/self/auxv"))
        if hwcaps is not None:
            return CpuFeatures(decode_arm_hwcaps(*hwcaps), "auxv", model)
        features = fields.get("Features")
        if features is not None:
            return CpuFeatures(frozenset(features.split()) & set(ARM_FEATURES), "cpuinfo Features", model)
        return CpuFeatures(frozenset(), "none", model)
    return CpuFeatures(frozenset(), "none", fields.get("model name"))


def _x86_features(root: Path, fields: dict[str, str]) -> CpuFeatures:
    """The kernel's flags, narrowed on the live host to what CPUID says this process can run (under qemu-user
    the flags are the host's, the instructions the emulated CPU's)."""
    flags, model = fields.get("flags"), fields.get("model name")
    kernel = frozenset(flags.split()) & set(X86_FEATURES) if flags is not None else None
    executable = cpuid_features() if root == Path("/") else None
    if root == Path("/") and (isa := forced_isa()) is not None:
        kernel = kernel & FORCED_ISA_FLAGS[isa] if kernel is not None else None
        executable = executable & FORCED_ISA_FLAGS[isa] if executable is not None else None
    if executable is None:
        return CpuFeatures(kernel or frozenset(), "cpuinfo flags" if kernel is not None else "none", model)
    if kernel is None:
        return CpuFeatures(executable, "cpuid", model)
    return CpuFeatures(kernel & executable, "cpuinfo flags and cpuid", model)


def first_processor_fields(cpuinfo: str) -> dict[str, str]:
    """ "key : value" pairs of the first processor block (features are uniform across CPUs)."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def all_cpu_flags() -> list[str]:
    """The kernel's whole flag list of the first processor (x86 "flags", arm64 "Features"; empty if unreadable),
    for what names every extension (a build's -m flags, a native build's ISA stamp), not only the probe's; cut
    to the forced ISA's class where one is forced."""
    fields = first_processor_fields(read_text(Path("/"), "proc/cpuinfo") or "")
    if (flags := fields.get("flags")) is not None and (isa := forced_isa()) is not None:
        return [flag for flag in flags.split() if flag in FORCED_ISA_FLAGS[isa]]
    return (flags or fields.get("Features") or "").split()


def read_auxv_hwcaps(data: bytes | None) -> tuple[int, int] | None:
    """(AT_HWCAP, AT_HWCAP2) from an auxv image, or None when absent or unreadable.

    auxv is a list of (key, value) pairs of unsigned longs in native byte order, ended by
    AT_NULL. spark-edge only runs 64-bit userlands (vLLM ships no 32-bit wheels), so pairs are
    8 + 8 bytes.
    """
    if not data or len(data) % 16:
        return None
    hwcap: int | None = None
    hwcap2 = 0  # older kernels do not emit AT_HWCAP2: no bits set
    for key, value in struct.iter_unpack("=QQ", data):
        if key == 0:  # AT_NULL
            break
        if key == AT_HWCAP:
            hwcap = value
        elif key == AT_HWCAP2:
            hwcap2 = value
    return (hwcap, hwcap2) if hwcap is not None else None


def decode_arm_hwcaps(hwcap: int, hwcap2: int) -> frozenset[str]:
    words = {AT_HWCAP: hwcap, AT_HWCAP2: hwcap2}
    return frozenset(name for name, (word, bit) in ARM_HWCAP_BITS.items() if words[word] & bit)


def _arm_model(fields: dict[str, str]) -> str | None:
    implementer, part = fields.get("CPU implementer"), fields.get("CPU part")
    if implementer is None or part is None:
        return fields.get("model name")
    try:
        implementer_id, part_id = int(implementer, 16), int(part, 16)
    except ValueError:
        return None
    if implementer_id == 0x41 and part_id in ARM_PARTS:
        return f"Arm {ARM_PARTS[part_id]}"
    return f"implementer {implementer}, part {part}"


@functools.cache
def host_has_bf16_gemm() -> bool:
    """Whether this host's oneDNN bf16 GEMMs run on bf16 hardware."""
    return bool(probe_cpu_features(Path("/"), platform.machine()).names & BF16_GEMM_FEATURES)


@functools.cache
def host_has_amx_bf16() -> bool:
    """Whether this CPU has AMX bf16 tiles (oneDNN's bf16 GEMM runs on them where the process may use them)."""
    return "amx_bf16" in probe_cpu_features(Path("/"), platform.machine()).names


@functools.cache
def host_has_int8_dot() -> bool:
    """Whether this x86 CPU runs int8 GEMMs on integer dot products (AVX512-VNNI, AVX-VNNI or AMX int8)."""
    return bool(probe_cpu_features(Path("/"), platform.machine()).names & INT8_DOT_FEATURES)


@functools.cache
def host_runs_packed_int8_gemm() -> bool:
    """Whether this CPU runs vLLM's packed int8 GEMM (`int8_scaled_mm_with_quant`, in its AVX-512 build of
    `_C`): on AMX int8 tiles, or without them on AVX512-VNNI micro-kernels. Every AMX CPU has AVX512-VNNI;
    Skylake-SP's AVX-512 has none."""
    return PACKED_INT8_FEATURES <= probe_cpu_features(Path("/"), platform.machine()).names


@functools.cache
def host_has_arm_dotprod() -> bool:
    """Whether this arm64 CPU has the int8 dot product (SDOT, ARMv8.2+): KleidiAI's least int4 kernel needs it."""
    return "asimddp" in probe_cpu_features(Path("/"), platform.machine()).names
