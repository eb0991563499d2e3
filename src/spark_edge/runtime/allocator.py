"""malloc replacements a server's processes can preload: jemalloc and tcmalloc from Debian's packages.

vLLM warns at every start that tcmalloc is not preloaded; what each changes here (settled RSS, decode and
prefill speed) is measured side by side by `spark-edge bench --paths w4a16,w4a16+jemalloc,w4a16+tcmalloc`
(the bench's variants preload them with LD_PRELOAD into the server and the engine process it spawns).
"""

from __future__ import annotations

import platform
from pathlib import Path

# name -> the shared library its Debian package installs
LIBRARIES = {"jemalloc": "libjemalloc.so.2", "tcmalloc": "libtcmalloc_minimal.so.4"}
PACKAGES = {"jemalloc": "libjemalloc2", "tcmalloc": "libtcmalloc-minimal4"}
_MULTIARCH = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu"}


def library_path(name: str) -> Path | None:
    """The allocator's library on this host, or None when its package is not installed."""
    directory = _MULTIARCH.get(platform.machine(), "")
    for root in (Path("/usr/lib") / directory, Path("/usr/lib"), Path("/lib") / directory):
        candidate = root / LIBRARIES[name]
        if candidate.is_file():
            return candidate
    return None
