"""The memory ceiling a server's plan works under, and where it came from.

The probe reports what is still free: the cgroup limit minus what the cgroup already holds
(or the host's available memory). When `serve` probes, its own process is already in that
cgroup, having imported torch; but the plan's runtime baseline counts this process too (it
becomes vLLM's API server). So what this process already holds anonymously is given back,
or it would be counted twice and a limit that fits would be refused.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from spark_edge.metrics.process_tree import rss_anon_bytes
from spark_edge.probe.memory import MemoryBudget

MiB = 1 << 20


@dataclass(frozen=True)
class Ceiling:
    bytes: int
    source: str  # said in the start log and in a refusal: where the number came from

    def describe(self) -> str:
        return f"ceiling {self.bytes / MiB:.0f} MiB ({self.source})"


def serving_ceiling(memory: MemoryBudget, explicit: int | None = None, own_anon: int | None = None) -> Ceiling:
    """The ceiling for a server started from this process: `explicit` (--memory-limit) wins."""
    if explicit:
        return Ceiling(explicit, "--memory-limit")
    own = rss_anon_bytes(os.getpid()) if own_anon is None else own_anon
    if memory.cgroup_limit is not None and memory.ceiling < memory.host_available:
        used = memory.cgroup_used or 0
        # what the cgroup still has, plus what this process holds (it is part of the plan's baseline)
        ceiling = min(memory.host_available, memory.cgroup_limit - used + min(own, used))
        return Ceiling(
            ceiling,
            f"cgroup limit {memory.cgroup_limit / MiB:.0f} MiB, {used / MiB:.0f} MiB "
            f"of it in use, {min(own, used) / MiB:.0f} MiB of that by this process",
        )
    return Ceiling(
        memory.ceiling + own,
        f"host memory available {memory.host_available / MiB:.0f} MiB, plus {own / MiB:.0f} MiB this process holds",
    )
