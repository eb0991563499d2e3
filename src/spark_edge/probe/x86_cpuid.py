"""The x86 features this process can execute, asked of the CPU itself (CPUID and XGETBV).

/proc/cpuinfo is the kernel's description of the machine's CPUs. Under qemu-user emulation (how an AVX2-only
CPU is tested on an AVX-512 machine) it still names the host's AVX-512 while the emulated process has none:
only the CPUID instruction, run in this process, answers for the CPU that will execute our code. XGETBV adds
what the kernel enabled (a CPU's AVX-512 or AMX is unusable until the OS saves its registers). cpuid-native
runs both instructions; without it (not an x86 wheel) the caller keeps the kernel's flags.
"""

from __future__ import annotations

# (leaf, subleaf, register index in EAX, EBX, ECX, EDX, bit) for each feature, as the Intel SDM lists them;
# names are the kernel's cpuinfo spellings (cpu_features.X86_FEATURES)
CPUID_BITS = {
    "fma": (1, 0, 2, 12),
    "f16c": (1, 0, 2, 29),
    "avx2": (7, 0, 1, 5),
    "avx512f": (7, 0, 1, 16),
    "avx512dq": (7, 0, 1, 17),
    "avx512bw": (7, 0, 1, 30),
    "avx512vl": (7, 0, 1, 31),
    "avx512_vnni": (7, 0, 2, 11),
    "amx_bf16": (7, 0, 3, 22),
    "amx_tile": (7, 0, 3, 24),
    "amx_int8": (7, 0, 3, 25),
    "avx_vnni": (7, 1, 0, 4),
    "avx512_bf16": (7, 1, 0, 5),
}
OSXSAVE = (1, 0, 2, 27)

# XCR0 state components the OS must save for each register file (SDM vol. 1, 13.1)
XCR0_AVX = 0b110  # SSE and AVX (YMM) state
XCR0_AVX512 = 0b1110_0000  # opmask, ZMM_Hi256, Hi16_ZMM
XCR0_AMX = 0b11 << 17  # XTILECFG, XTILEDATA


def _required_state(name: str) -> int:
    if name.startswith("amx"):
        return XCR0_AVX | XCR0_AMX
    if name.startswith("avx512"):
        return XCR0_AVX | XCR0_AVX512
    return XCR0_AVX  # FMA, F16C, AVX2 and AVX-VNNI work on YMM registers


def cpuid_features() -> frozenset[str] | None:
    """The features CPUID reports and the OS enabled, or None when cpuid-native is not installed."""
    try:
        import cpuid_native
    except ImportError:
        return None

    def bit(leaf: int, subleaf: int, register: int, position: int) -> bool:
        return bool(cpuid_native.get_cpuid_count(leaf, subleaf)[1 + register] >> position & 1)

    max_leaf = cpuid_native.get_cpuid(0)[1]
    max_subleaf = {1: 0, 7: cpuid_native.get_cpuid_count(7, 0)[1] if max_leaf >= 7 else -1}
    enabled = cpuid_native.xgetbv(0) if bit(*OSXSAVE) else 0
    return frozenset(
        name
        for name, (leaf, subleaf, register, position) in CPUID_BITS.items()
        if leaf <= max_leaf
        and subleaf <= max_subleaf[leaf]
        and bit(leaf, subleaf, register, position)
        and enabled & _required_state(name) == _required_state(name)
    )
