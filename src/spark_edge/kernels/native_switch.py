"""Whether spark-edge's C++ int4 ops are wanted and can be built here, and whether KleidiAI serves the linears:
cheap (no torch import), so the compile-cache stamp can name which ops the cpu_int4 layers put into the compiled
graph."""

from __future__ import annotations

import os
import platform
import shutil

from spark_edge.environment import kernel_enabled
from spark_edge.probe.cpu_features import host_has_arm_dotprod

LIBRARY = "spark_edge_int4"  # its name in SPARK_EDGE_DISABLED_KERNELS: the torch paths serve


def cxx_compiler() -> str | None:
    """The C++ compiler the ops are built with ($CXX, else c++ or g++ on PATH), or None."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def native_ops_wanted() -> bool:
    """The library is not disabled and a compiler is there (the build itself can still fail: then a warning)."""
    return kernel_enabled(LIBRARY) and cxx_compiler() is not None


def kleidiai_wanted() -> bool:
    """An arm64 CPU with SDOT, and `kleidiai` not disabled: the linears take KleidiAI where torch's build has it
    (kernels/kleidiai_int4.py; torch's version is in the stamp already)."""
    return platform.machine() in ("aarch64", "arm64") and host_has_arm_dotprod() and kernel_enabled("kleidiai")


def int4_ops_form() -> str:
    """The ops cpu_int4 layers put into a compiled graph here: the C++ library's or torch's, and KleidiAI's."""
    form = "native" if native_ops_wanted() else "torch"
    return f"{form}+kleidiai" if kleidiai_wanted() else form
