"""How many cores this process can keep busy: affinity mask, cgroup CPU quota, NUMA nodes.

Rounding rule: usable_cores = max(1, min(len(affinity), floor(quota))). With a 1.5 CPU quota,
two busy threads burn the period's budget in 75 ms of every 100 ms and are then throttled
together; vLLM's OpenMP decode loop synchronises its threads every step, so one throttled
thread stalls them all. One thread runs unthrottled and leaves half a CPU for the HTTP server
and tokenizer. A quota under one CPU still gets one thread (it will be throttled, but zero
threads cannot serve).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from spark_edge.probe.cgroups import CgroupDirs, cgroup_dirs
from spark_edge.probe.procfs import parse_cpu_list, read_text

NODE_DIR = "sys/devices/system/node"


@dataclass(frozen=True)
class NumaNode:
    node: int
    cpus: tuple[int, ...]


@dataclass(frozen=True)
class CpuBudget:
    affinity: tuple[int, ...]  # CPUs this process may run on (cpuset and taskset already applied)
    cgroup_quota: float | None  # CPUs' worth of time per period allowed by the cgroup; None = unlimited
    usable_cores: int
    numa_nodes: tuple[NumaNode, ...]  # empty when the kernel exposes no NUMA information


def probe_cpus(root: Path, live: bool) -> CpuBudget:
    """`live` means `root` is this machine's "/", so the process's own affinity can be asked."""
    allowed = affinity(root, live)
    quota = cgroup_cpu_quota(root)
    return CpuBudget(
        affinity=allowed,
        cgroup_quota=float(quota) if quota is not None else None,
        usable_cores=usable_cores(len(allowed), quota),
        numa_nodes=numa_nodes(root),
    )


def affinity(root: Path, live: bool) -> tuple[int, ...]:
    if live:
        return tuple(sorted(os.sched_getaffinity(0)))
    # Fixture trees describe the mask the way the kernel shows it to the process itself.
    for line in (read_text(root, "proc/self/status") or "").splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return parse_cpu_list(line.split(":", 1)[1])
    online = read_text(root, "sys/devices/system/cpu/online")
    if online is not None:
        return parse_cpu_list(online)
    raise FileNotFoundError(f"{root}: neither proc/self/status (Cpus_allowed_list) nor sys/devices/system/cpu/online")


def cgroup_cpu_quota(root: Path) -> Fraction | None:
    """The tightest CPU quota over the process's cgroup and its ancestors, in CPUs."""
    where = cgroup_dirs(root, "cpu")
    if where is None:
        return None
    quotas = [q for q in (_quota_in(root, where, d) for d in where.dirs) if q is not None]
    return min(quotas) if quotas else None


def _quota_in(root: Path, where: CgroupDirs, folder: Path) -> Fraction | None:
    if where.version == 2:
        # cpu.max: "max 100000" (unlimited) or "150000 100000" (quota and period, microseconds)
        fields = (read_text(folder, "cpu.max") or "").split()
        if not fields or fields[0] == "max":
            return None
        period = int(fields[1]) if len(fields) > 1 else 100_000
        return Fraction(int(fields[0]), period)
    quota_text = read_text(folder, "cpu.cfs_quota_us")
    period_text = read_text(folder, "cpu.cfs_period_us")
    if quota_text is None or period_text is None or int(quota_text) < 0:  # -1 means unlimited
        return None
    return Fraction(int(quota_text), int(period_text))


def usable_cores(affinity_count: int, quota: Fraction | float | None) -> int:
    """See the module docstring for why the quota is floored but never below one."""
    if quota is None:
        return max(1, affinity_count)
    return max(1, min(affinity_count, math.floor(quota)))


def numa_nodes(root: Path) -> tuple[NumaNode, ...]:
    base = root / NODE_DIR
    if not base.is_dir():
        return ()
    nodes = []
    for entry in base.iterdir():
        if entry.name.startswith("node") and entry.name[4:].isdigit():
            cpulist = read_text(entry, "cpulist")
            if cpulist is not None:
                nodes.append(NumaNode(int(entry.name[4:]), parse_cpu_list(cpulist)))
    return tuple(sorted(nodes, key=lambda n: n.node))
