"""Which weight path a host should serve, and why.

- x86-64 with AMX int8 usable: w4a8 (vLLM's AMX kernel, int8 activations) for speed;
  w4a16 for fidelity, which keeps bf16 activations at some decode speed. Measured side by side on a
  Xeon AMX host (docs/benchmarks.md): on a 1.7B shape w4a8 decodes 1.16x and serves 4 streams 1.18x
  w4a16, which prefills 1.18x w4a8; on the default model w4a16 decodes 1.12x w4a8 and w4a8 serves 4
  streams 1.21x; w4a8's perplexity is x1.571 bf16's there against w4a16's x1.061. Decode of the
  mission's 1-2 B models decides the speed default.
- x86-64 with AVX-512 or AVX2: w4a16.
- arm64 with NEON: w4a16, unverified: no spark-edge path has run on real ARM hardware yet.
- An explicit weight path wins, unless the host cannot run it.

`verified` says whether the path has been run on this class of CPU, not whether it will load.
"""

from __future__ import annotations

from dataclasses import dataclass

from spark_edge import registry
from spark_edge.errors import UnsupportedHostError
from spark_edge.probe.device import DeviceProfile
from spark_edge.probe.isa import amx_missing_reason, amx_w4a8_ready, bf16_native, has_avx512, host_problem

WEIGHT_PATHS = tuple(registry.WEIGHT_PATHS)
PRIORITIES = ("speed", "fidelity")


@dataclass(frozen=True)
class WeightPathChoice:
    name: str
    reason: str
    verified: bool
    notes: tuple[str, ...] = ()


def select_weight_path(
    profile: DeviceProfile, priority: str = "speed", explicit: str | None = None
) -> WeightPathChoice:
    """Raises UnsupportedHostError when the host cannot run vLLM, or cannot run `explicit`."""
    if priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {PRIORITIES}, not {priority!r}")
    if explicit is not None and explicit not in WEIGHT_PATHS:
        raise ValueError(f"weight path must be one of {WEIGHT_PATHS}, not {explicit!r}")
    problem = host_problem(profile)
    if problem is not None:
        raise UnsupportedHostError(problem)
    if explicit is not None:
        return _explicit(profile, explicit)
    if profile.machine == "aarch64":
        return _arm_w4a16(profile, "arm64 with NEON: the 4-bit weight path with bf16 activations")
    return _x86_choice(profile, priority)


def _x86_choice(profile: DeviceProfile, priority: str) -> WeightPathChoice:
    if amx_w4a8_ready(profile):
        if priority == "speed":
            return WeightPathChoice(
                "w4a8",
                "AMX int8 tiles are usable: vLLM's AMX kernel multiplies 4-bit weights with int8 "
                "activations, the fastest decode on this CPU for 1-2 B models (w4a16 prefills faster and keeps "
                "closer to bf16: --priority fidelity)",
                verified=True,
                notes=_bf16_notes(profile),
            )
        return WeightPathChoice(
            "w4a16",
            "fidelity priority: bf16 activations instead of int8 (w4a8 would decode faster on this AMX CPU)",
            verified=True,
            notes=_bf16_notes(profile),
        )
    if has_avx512(profile):
        return WeightPathChoice(
            "w4a16",
            f"AVX-512 without usable AMX ({amx_missing_reason(profile)}): 4-bit weights with bf16 activations",
            verified=True,
            notes=_bf16_notes(profile),
        )
    return WeightPathChoice(
        "w4a16",
        "AVX2 without AVX-512: 4-bit weights with bf16 activations on spark-edge's AVX2 int4 kernels "
        "(verified by forcing them on an AVX-512 host: ATEN_CPU_CAPABILITY=avx2)",
        verified=True,
        notes=_bf16_notes(profile),
    )


def _arm_w4a16(profile: DeviceProfile, reason: str) -> WeightPathChoice:
    notes = ["not yet verified on real ARM hardware (vLLM documents NEON as its only ARM requirement)"]
    if not profile.has("asimddp"):
        notes.append("no int8 dot product (asimddp): expect slow 4-bit kernels")
    notes.extend(_bf16_notes(profile))
    return WeightPathChoice("w4a16", reason, verified=False, notes=tuple(notes))


def _explicit(profile: DeviceProfile, name: str) -> WeightPathChoice:
    reason = f"{name} was asked for explicitly"
    path = registry.weight_path(name)
    if profile.machine not in path.machines:
        raise UnsupportedHostError(path.elsewhere)
    if name == "w4a8" and not amx_w4a8_ready(profile):
        # vLLM runs a w4a8 (GPTQ) checkpoint without AMX through its W4A16 vector kernel: it
        # works, but it is not the AMX path, so say so rather than refuse (benchmarks use it).
        return WeightPathChoice(
            name,
            reason,
            verified=False,
            notes=(
                f"{amx_missing_reason(profile)}: vLLM runs this checkpoint through its W4A16 vector "
                "kernel, not the AMX one; w4a16 is the faster 4-bit path here",
                *_bf16_notes(profile),
            ),
        )
    if name == "w4a8":
        return WeightPathChoice(name, reason, verified=True, notes=_bf16_notes(profile))
    if profile.machine == "aarch64":
        return (
            _arm_w4a16(profile, reason)
            if name == "w4a16"
            else WeightPathChoice(
                name, reason, verified=False, notes=("not yet verified on real ARM hardware", *_bf16_notes(profile))
            )
        )
    verified = has_avx512(profile)
    notes = () if verified else ("measured only on AVX-512 CPUs so far",)
    return WeightPathChoice(name, reason, verified=verified, notes=notes + _bf16_notes(profile))


def _bf16_notes(profile: DeviceProfile) -> tuple[str, ...]:
    if bf16_native(profile):
        return ()
    return ("no native bf16 arithmetic: bf16 activations go through fp32 conversions (correct, slower)",)
