"""Which weight path a host should serve, and why.

- x86-64 with AMX int8 usable: w4a16 or w4a8 (vLLM's AMX kernel, int8 activations), whichever the bench
  measured faster on this host class and this model's shape among those within the fidelity gate
  (measured_paths.py); where neither was measured on this shape, w4a16: int8 activations failed the gate
  where they were scored (the default model, x1.571 bf16's perplexity). `--priority fidelity`: w4a16.
- x86-64 with AVX-512 or AVX2: w4a16.
- arm64 with NEON: w4a16, unverified: no spark-edge path has run on real ARM hardware yet.
- An explicit weight path wins, unless the host cannot run it (w4a8 without AVX-512: vLLM's _C_AVX2 has no GPTQ
  kernel); a note says when it failed the gate.

`verified` says whether the path has been run on this class of CPU, not whether it will load.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from spark_edge import registry
from spark_edge.errors import UnsupportedHostError
from spark_edge.probe.device import DeviceProfile
from spark_edge.probe.isa import amx_missing_reason, amx_w4a8_ready, bf16_native, has_avx512, host_problem, isa_label
from spark_edge.probe.measured_paths import Evidence

EvidenceFor = Callable[[str], "Evidence | None"]  # host class -> what was measured there for the model asked for

WEIGHT_PATHS = tuple(registry.WEIGHT_PATHS)
PRIORITIES = ("speed", "fidelity")


@dataclass(frozen=True)
class WeightPathChoice:
    name: str
    reason: str
    verified: bool
    notes: tuple[str, ...] = ()


def select_weight_path(
    profile: DeviceProfile,
    priority: str = "speed",
    explicit: str | None = None,
    measured: EvidenceFor = lambda isa: None,
) -> WeightPathChoice:
    """Raises UnsupportedHostError when the host cannot run vLLM, or cannot run `explicit`. `measured` is asked
    only where the host runs more than one 4-bit path at its own kernels (reading a model's config costs time)."""
    if priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {PRIORITIES}, not {priority!r}")
    if explicit is not None and explicit not in WEIGHT_PATHS:
        raise ValueError(f"weight path must be one of {WEIGHT_PATHS}, not {explicit!r}")
    problem = host_problem(profile)
    if problem is not None:
        raise UnsupportedHostError(problem)
    if explicit is not None:
        choice = _explicit(profile, explicit)
        if amx_w4a8_ready(profile) and (found := measured(isa_label(profile))):
            if problem := found.gate_problem(explicit):
                return WeightPathChoice(choice.name, choice.reason, choice.verified, (problem, *choice.notes))
        return choice
    if profile.machine == "aarch64":
        return _arm_w4a16(profile, "arm64 with NEON: the 4-bit weight path with bf16 activations")
    return _x86_choice(profile, priority, measured)


AMX_CANDIDATES = ("w4a16", "w4a8")  # the 4-bit paths an AMX host runs at their own kernels


def _x86_choice(profile: DeviceProfile, priority: str, measured: EvidenceFor) -> WeightPathChoice:
    if amx_w4a8_ready(profile):
        notes = _bf16_notes(profile)
        if priority == "fidelity":
            return WeightPathChoice("w4a16", "fidelity priority: bf16 activations, not int8", True, notes)
        found = measured(isa_label(profile))
        picked = found.pick(AMX_CANDIDATES) if found else None
        if picked:
            return WeightPathChoice(picked[0], f"AMX host, {picked[1]}", verified=True, notes=notes)
        return WeightPathChoice(
            "w4a16",
            "AMX host: w4a16 and w4a8 were not both measured on this model shape here, and int8 activations "
            "failed the fidelity gate where they were scored (`spark-edge bench --paths bf16,w4a16,w4a8` on this "
            "model measures them; scripts/measured_paths.py records it)",
            verified=True,
            notes=notes,
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
    if name == "w4a8" and not has_avx512(profile):
        # vLLM's AVX2 build of its CPU ops (_C_AVX2), which it loads on such CPUs, has none of the GPTQ kernels
        # (neither int4_scaled_mm_cpu nor cpu_gemm_wna16): the engine would die at its first forward
        raise UnsupportedHostError(
            "w4a8 runs vLLM's GPTQ kernels, which its build for CPUs without AVX-512 (_C_AVX2) lacks, and this "
            "CPU has no AVX-512: serve w4a16 (spark-edge's int4 kernels have an AVX2 path)"
        )
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
