"""Content hashes for checkpoint files and sources."""

from __future__ import annotations

import hashlib
from pathlib import Path

_CHUNK = 8 << 20


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def files_sha256(paths: list[Path], root: Path) -> str:
    """One hash over several files: their paths relative to `root` and their contents."""
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + file_sha256(path).encode() + b"\0")
    return digest.hexdigest()
