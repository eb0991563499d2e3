"""The shared libraries an ELF file asks the dynamic linker for (its DT_NEEDED entries).

Pure Python, so the host needs no binutils: the arm64 image's site-packages are assembled on an
x86-64 host, and which NVIDIA libraries torch really loads is read from the libraries themselves.
Only 64-bit little-endian files are read (aarch64 and x86-64 both are).
"""

from __future__ import annotations

import struct
from pathlib import Path

_MAGIC = b"\x7fELF"
_SHT_DYNAMIC = 6
_DT_NULL, _DT_NEEDED = 0, 1


def is_elf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == _MAGIC


def needed(path: Path) -> list[str]:
    """The file's DT_NEEDED sonames, in order; [] for a file with no dynamic section."""
    data = path.read_bytes()
    if data[:4] != _MAGIC or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path}: not a 64-bit little-endian ELF file")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    for _, sh_type, _, _, offset, size, link, _, _, entsize in sections:
        if sh_type != _SHT_DYNAMIC:
            continue
        strtab = sections[link][4]  # the section holding the names: sh_link of .dynamic
        names = []
        for pos in range(offset, offset + size, entsize or 16):
            tag, value = struct.unpack_from("<qQ", data, pos)
            if tag == _DT_NULL:
                break
            if tag == _DT_NEEDED:
                end = data.index(b"\0", strtab + value)
                names.append(data[strtab + value : end].decode())
        return names
    return []


def closure(roots: list[Path], available: dict[str, Path]) -> set[Path]:
    """The files of `available` (soname -> file) that loading `roots` pulls in, transitively.

    Sonames not in `available` are the system's (libc, libstdc++...) and are not followed.
    """
    seen: set[Path] = set()
    todo = list(roots)
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        todo.extend(available[name] for name in needed(path) if name in available)
    return seen
