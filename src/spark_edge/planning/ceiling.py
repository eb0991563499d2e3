"""The memory ceiling a server's plan works under, and where it came from.

The probe reports what is still free: the cgroup limit minus what the cgroup already holds
(or the host's available memory). When `serve` probes, its own process is already in that
cgroup, having imported torch; but the plan's runtime baseline counts this process too (it
becomes vLLM's API server). So what this process already holds anonymously is given back,
or it would be counted twice and a limit that fits would be refused.

The pages of the libraries it mapped are given back too, as far as the cgroup holds them: a page
of a shared file is charged to the cgroup that first read it, so the first container on a node
pays for torch's libraries and the next ones do not (AMD EPYC Zen 4 host, the avx512 image: 75 MiB
of mapped files charged to the first container after a cold page cache, 0 to the two after it).
Counted as held, they made the smallest limit a plan accepts depend on which container started
first. They are clean file pages the kernel reclaims before it kills anything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from spark_edge.probe.memory import MemoryBudget
from spark_edge.probe.procfs import rss_anon_bytes

MiB = 1 << 20


@dataclass(frozen=True)
class OwnMemory:
    """This process's resident memory, read when the probe reads the cgroup."""

    anon: int
    file: int  # the files it maps: the libraries it has imported

    @classmethod
    def now(cls) -> OwnMemory:
        pid = os.getpid()
        return cls(rss_anon_bytes(pid), rss_anon_bytes(pid, "RssFile"))


def own_share(memory: MemoryBudget, own: OwnMemory) -> int:
    """What of the cgroup's usage is this process's: its anonymous memory and the pages of its mapped files
    the cgroup was charged for (none, if another cgroup read them first); never more than the usage."""
    used = memory.cgroup_used or 0
    return min(own.anon + min(own.file, memory.cgroup_mapped or 0), used)


@dataclass(frozen=True)
class Ceiling:
    bytes: int
    source: str  # said in the start log and in a refusal: where the number came from

    def describe(self) -> str:
        return f"ceiling {self.bytes / MiB:.0f} MiB ({self.source})"


def serving_ceiling(memory: MemoryBudget, explicit: int | None = None, own: OwnMemory | None = None) -> Ceiling:
    """The ceiling for a server started from this process: `explicit` (--memory-limit) wins."""
    if explicit:
        return Ceiling(explicit, "--memory-limit")
    own = own or OwnMemory.now()
    if memory.cgroup_limit is not None and memory.ceiling < memory.host_available:
        used, mine = memory.cgroup_used or 0, own_share(memory, own)
        # what the cgroup still has, plus what this process holds (it is part of the plan's baseline)
        ceiling = min(memory.host_available, memory.cgroup_limit - used + mine)
        return Ceiling(
            ceiling,
            f"cgroup limit {memory.cgroup_limit / MiB:.0f} MiB, {used / MiB:.0f} MiB "
            f"of it in use, {mine / MiB:.0f} MiB of that by this process",
        )
    available, mine = memory.host_available / MiB, own.anon / MiB
    source = f"host memory available {available:.0f} MiB, plus {mine:.0f} MiB this process holds"
    return Ceiling(memory.ceiling + own.anon, source)
