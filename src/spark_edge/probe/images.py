"""Whether a spark-edge container image's ISA fits this host, and which image does.

An image built for an ISA the CPU lacks dies with SIGILL somewhere inside a kernel, long after
start; checking at start turns that into a message naming the image to pull instead.
"""

from __future__ import annotations

from spark_edge import registry
from spark_edge.probe.device import DeviceProfile
from spark_edge.probe.isa import AVX512, X86_FLOOR, amx_missing_reason, has_avx512, host_problem, isa_label

IMAGES = {isa: image.tag for isa, image in registry.IMAGES.items()}


def image_fits(image_isa: str, profile: DeviceProfile) -> bool:
    """The host runs vLLM's CPU build and is of a class the image runs on (the one classification, isa_label)."""
    return host_problem(profile) is None and isa_label(profile) in registry.image(image_isa).runs_on


def recommended_image(profile: DeviceProfile) -> str | None:
    """The most specific image this host runs (the registry lists them in that order), or None when none fits."""
    return next((image.tag for isa, image in registry.IMAGES.items() if image_fits(isa, profile)), None)


def image_isa_problem(image_isa: str, profile: DeviceProfile) -> str | None:
    """None when an image built for `image_isa` runs here; otherwise a message naming what to use."""
    if image_fits(image_isa, profile):
        return None
    message = f"{IMAGES[image_isa]} needs {registry.image(image_isa).needs}, and {_why_not(image_isa, profile)}"
    instead = recommended_image(profile)
    if instead is not None:
        return f"{message}: use {instead} instead"
    return f"{message}; no spark-edge image runs here: {host_problem(profile)}"


def _why_not(image_isa: str, profile: DeviceProfile) -> str:
    if image_isa == "arm64" or profile.machine != "x86_64":
        return f"this CPU is {profile.machine}"
    if image_isa == "amx" and has_avx512(profile):
        return amx_missing_reason(profile)
    missing = [f for f in (X86_FLOOR if image_isa == "avx2" else AVX512) if f not in profile.features]
    return f"this CPU lacks {', '.join(missing)}"
