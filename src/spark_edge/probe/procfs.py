"""Reading /proc and /sys files below an injectable root folder.

A missing or unreadable file is an ordinary answer here (a kernel without NUMA, a container
without a cgroup file), so readers return None and callers choose the fallback.
"""

from __future__ import annotations

from pathlib import Path


def read_text(root: Path, path: str | Path) -> str | None:
    try:
        return (root / str(path).lstrip("/")).read_text()
    except (OSError, UnicodeDecodeError):
        return None


def read_bytes(root: Path, path: str | Path) -> bytes | None:
    try:
        return (root / str(path).lstrip("/")).read_bytes()
    except OSError:
        return None


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """The kernel's CPU list format ("0-3,8,10-11") as sorted CPU numbers."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return tuple(sorted(cpus))


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo as bytes ("MemTotal:  24684084 kB" -> {"MemTotal": 25276502016})."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if not fields or not fields[0].isdigit():
            continue
        scale = 1024 if len(fields) > 1 and fields[1] == "kB" else 1
        values[key.strip()] = int(fields[0]) * scale
    return values


def parse_flat_keyed(text: str) -> dict[str, int]:
    """A cgroup "key value" file such as memory.stat."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[1].lstrip("-").isdigit():
            values[fields[0]] = int(fields[1])
    return values


def rss_anon_bytes(pid: int, field: str = "RssAnon") -> int:
    """RssAnon (or another /proc/PID/status RSS field: RssFile) of one process; 0 if it has gone."""
    try:
        for line in (Path("/proc") / str(pid) / "status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
