"""One-pass dequantization of the int4 kernel buffer for multi-row GEMMs, in C, built on the host.

The multi-row path (prefill, batched decode) dequantizes every weight once per forward.  Done
with torch elementwise ops that takes about eight passes over [N, K] temporaries (~2 ns per
weight on one core here, more than the bf16 GEMM it feeds); the C loop in native/int4_dequant.c
does it in one pass.  It is compiled on first use with the host's C compiler (the one Inductor
already needs), `-march=native`, into the data folder under a key of the source, the flags, the
compiler and the CPU's flags, so a library built on another CPU is never loaded (a cache volume
moved between hosts cannot cause an illegal instruction).  Before use it is checked bit for bit
against the reference dequantizer; if there is no compiler, the build fails, or the check fails,
the torch path is used and a warning says why.

SPARK_EDGE_NATIVE_DEQUANT=0 turns it off (for side-by-side benchmarks).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from spark_edge.paths import spark_edge_home

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "native" / "int4_dequant.c"
SYMBOL = "spark_edge_int4_dequant_t"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c11", "-shared", "-fPIC")
ENV_SWITCH = "SPARK_EDGE_NATIVE_DEQUANT"


class _Unavailable(Exception):
    pass


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [line for line in text.splitlines() if line.split(":")[0].strip() in ("flags", "Features")]
    return lines[0] if lines else ""


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise _Unavailable("no C compiler on PATH")
    return cc


def _build_key(cc: str) -> str:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    parts = (SOURCE.read_bytes(), " ".join(FLAGS).encode(), version.encode(), _cpu_flags().encode(),
             platform.machine().encode())
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _writable_kernel_dir() -> Path:
    for base in (spark_edge_home() / "kernels", Path(tempfile.gettempdir()) / "spark-edge-kernels"):
        try:
            base.mkdir(parents=True, exist_ok=True)
            if os.access(base, os.W_OK):
                return base
        except OSError:
            continue
    raise _Unavailable("no writable folder for the compiled kernel")


def _build() -> Path:
    cc = _compiler()
    target = _writable_kernel_dir() / _build_key(cc) / "int4_dequant.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    result = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(tmp)], capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise _Unavailable(f"{cc} failed: {result.stderr.strip()[-500:]}")
    os.replace(tmp, target)  # atomic: a concurrent process sees the old name or the whole library
    return target


def _load(path: Path) -> ctypes._CFuncPtr:
    fn = getattr(ctypes.CDLL(str(path)), SYMBOL)
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    return fn


def _call(fn: ctypes._CFuncPtr, buf: torch.Tensor, sz: torch.Tensor, group_size: int) -> torch.Tensor:
    from spark_edge.quant.tinygemm_layout import detect_layout

    layout = detect_layout()
    n, half_k = buf.shape
    k = half_k * 2
    out = torch.empty((k, n), dtype=torch.bfloat16)
    fn(buf.data_ptr(), sz.data_ptr(), out.data_ptr(), n, k, group_size, layout.block, int(layout.halves))
    return out


def _self_check(fn: ctypes._CFuncPtr) -> None:
    """Bit-exact against the reference on full blocks plus a 16-channel tail (in every known
    layout: 80 = 64 + 16 = 2 x 32 + 16 = 5 x 16), several groups."""
    from spark_edge.quant.tinygemm_layout import dequantize_kernel_weight, pack_for_kernel, scales_and_zeros

    gen = torch.Generator().manual_seed(0)
    n, k, group = 80, 128, 32
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(n, k // group, generator=gen) * 0.02 + 1e-4).to(torch.bfloat16)
    zero = (torch.randn(n, k // group, generator=gen) * 0.05).to(torch.bfloat16)
    buf, sz = pack_for_kernel(packed), scales_and_zeros(scale, zero)
    want = dequantize_kernel_weight(buf, sz, group).t()
    if not torch.equal(_call(fn, buf, sz, group).view(torch.int16), want.contiguous().view(torch.int16)):
        raise _Unavailable("the compiled kernel disagrees with the reference dequantizer")


@functools.lru_cache(maxsize=None)
def native_kernel() -> ctypes._CFuncPtr | None:
    """The checked C function, or None (torch fallback) with one warning saying why."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    try:
        fn = _load(_build())
        _self_check(fn)
        return fn
    except (_Unavailable, OSError, subprocess.SubprocessError) as exc:
        log.warning("spark-edge: native int4 dequantization unavailable (%s); using the slower torch path", exc)
        return None


def dequantize_kernel_weight_t(buf: torch.Tensor, sz: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """bf16 W^T [K, N] from the kernel buffer uint8 [N, K/2] and scales_and_zeros bf16 [G, N, 2], or None."""
    fn = native_kernel()
    if fn is None:
        return None
    if not (buf.is_contiguous() and sz.is_contiguous() and buf.dtype == torch.uint8 and sz.dtype == torch.bfloat16):
        raise ValueError("int4 dequantization needs the contiguous uint8 buffer and bf16 scales_and_zeros")
    return _call(fn, buf, sz, group_size)
