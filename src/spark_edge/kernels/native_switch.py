"""Whether spark-edge's C++ int4 ops are wanted and can be built here: cheap (no torch import), so the
compile-cache stamp can name which op the cpu_int4 layers put into the compiled graph."""

from __future__ import annotations

import os
import shutil

from spark_edge.environment import kernel_enabled

LIBRARY = "spark_edge_int4"  # its name in SPARK_EDGE_DISABLED_KERNELS: the torch paths serve


def cxx_compiler() -> str | None:
    """The C++ compiler the ops are built with ($CXX, else c++ or g++ on PATH), or None."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def native_ops_wanted() -> bool:
    """The library is not disabled and a compiler is there (the build itself can still fail: then a warning)."""
    return kernel_enabled(LIBRARY) and cxx_compiler() is not None
