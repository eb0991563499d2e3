"""How much memory spark-edge may still take: the host's and the cgroup's view, whichever is tighter.

The cgroup's own usage counts page cache, which the kernel reclaims before it kills anything,
so "used" here is usage minus the file pages no process maps (v2: memory.current - (inactive_file +
active_file - file_mapped), v1: memory.usage_in_bytes - (total_inactive_file + total_active_file -
total_mapped_file)). Counting cache as used makes a container that just read a 3 GB checkpoint look
full when it is not; and cache stays charged to a cgroup after its processes exit, so a server
restarted in the same container would find the ceiling its first life fitted under shrunk by the
checkpoint it read (active, having been read twice: at the manifest check and at load).

ceiling = min(host MemAvailable, cgroup limit - cgroup used), taking the tightest limit over the
process's cgroup and its ancestors.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from spark_edge.probe.cgroups import CgroupDirs, cgroup_dirs
from spark_edge.probe.procfs import parse_flat_keyed, parse_meminfo, read_text

# cgroup v1 shows "no limit" as LONG_MAX rounded down to a page (9223372036854771712); no real
# limit reaches 1 EiB, so anything at or above it is read as unlimited.
V1_UNLIMITED = 1 << 60


@dataclass(frozen=True)
class MemoryBudget:
    host_total: int  # bytes, MemTotal
    host_available: int  # bytes, MemAvailable
    cgroup_limit: int | None  # bytes, the tightest cgroup limit; None = no limit
    cgroup_used: int | None  # bytes that limit's cgroup already holds, page cache excluded
    ceiling: int  # bytes spark-edge may still allocate
    cgroup_mapped: int | None = None  # of cgroup_used, the file pages processes map (libraries, weights)


@dataclass(frozen=True)
class _CgroupLevel:
    limit: int | None
    used: int | None
    mapped: int = 0


def probe_memory(root: Path) -> MemoryBudget:
    total, available = host_memory(root)
    levels = cgroup_levels(root)
    limited = [lv for lv in levels if lv.limit is not None]
    if limited:
        binding = min(limited, key=lambda lv: lv.limit - (lv.used or 0))
    else:
        binding = levels[0] if levels else _CgroupLevel(None, None)
    ceiling = available
    if binding.limit is not None:
        ceiling = min(available, max(0, binding.limit - (binding.used or 0)))
    mapped = binding.mapped if binding.used is not None else None
    return MemoryBudget(total, available, binding.limit, binding.used, ceiling, mapped)


def host_memory(root: Path) -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes."""
    text = read_text(root, "proc/meminfo")
    if text is None:
        raise FileNotFoundError(f"{root / 'proc/meminfo'} is not readable")
    info = parse_meminfo(text)
    # MemAvailable exists since Linux 3.14; MemFree is the older, pessimistic stand-in.
    return info["MemTotal"], info.get("MemAvailable", info.get("MemFree", 0))


def cgroup_levels(root: Path) -> list[_CgroupLevel]:
    """Limit and usage of the process's memory cgroup, then of each ancestor."""
    where = cgroup_dirs(root, "memory")
    if where is None:
        return []
    return [_level(where, folder) for folder in where.dirs]


def _level(where: CgroupDirs, folder: Path) -> _CgroupLevel:
    if where.version == 2:
        limit = _read_int(folder, "memory.max")  # "max" reads as None
        usage = _read_int(folder, "memory.current")
        keys = ("inactive_file", "active_file", "file_mapped")
    else:
        limit = _read_int(folder, "memory.limit_in_bytes")
        if limit is not None and limit >= V1_UNLIMITED:
            limit = None
        usage = _read_int(folder, "memory.usage_in_bytes")
        # total_* includes child cgroups, as usage_in_bytes does.
        keys = ("total_inactive_file", "total_active_file", "total_mapped_file")
    stat = parse_flat_keyed(read_text(folder, "memory.stat") or "")
    inactive, active, mapped = (stat.get(key, stat.get(key.removeprefix("total_"), 0)) for key in keys)
    reclaimable = max(0, inactive + active - mapped)  # clean file cache nobody maps
    used = max(0, usage - reclaimable) if usage is not None else None
    return _CgroupLevel(limit, used, mapped)


def _read_int(folder: Path, name: str) -> int | None:
    text = (read_text(folder, name) or "").strip()
    return int(text) if text.lstrip("-").isdigit() else None


def oom_kills(root: Path = Path("/")) -> int:
    """OOM kills counted so far by this process's memory cgroup and its ancestors (v1 `memory.oom_control`,
    v2 `memory.events`); 0 without a memory cgroup. Read before and after a start to tell an OOM kill from
    another death."""
    where = cgroup_dirs(root, "memory")
    name = "memory.oom_control" if where and where.version == 1 else "memory.events"
    folders = where.dirs if where else ()
    return sum(parse_flat_keyed(read_text(folder, name) or "").get("oom_kill", 0) for folder in folders)
