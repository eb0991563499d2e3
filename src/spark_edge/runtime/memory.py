"""Hand memory the allocator has freed back to the operating system.

Loading a checkpoint and compiling the model allocate and free large temporary buffers.
glibc malloc keeps freed memory in its arenas (and tcmalloc in its page heap), so the
process's RssAnon stays at the load-time peak, and that is what counts against a
container's memory limit. `malloc_trim(0)` and tcmalloc's `MallocExtension_ReleaseFreeMemory`
return it. Symbols are looked up in the process's global namespace only: tcmalloc counts
only if it is already the process's allocator (LD_PRELOAD), and where the C library has no
`malloc_trim` (musl) there is nothing to do.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from spark_edge.environment import RELEASE_MEMORY
from spark_edge.probe.procfs import rss_anon_bytes

_LOG = logging.getLogger("vllm.spark_edge.memory")

_MIB = 1 << 20


@dataclass(frozen=True)
class Release:
    what: str
    rss_anon_before: int
    rss_anon_after: int
    releasers: tuple[str, ...]


def release_enabled() -> bool:
    """On unless SPARK_EDGE_RELEASE_MEMORY=0."""
    return not RELEASE_MEMORY.is_off()


def _global_symbol(name: str) -> Callable[..., int] | None:
    try:
        return getattr(ctypes.CDLL(None), name)
    except (AttributeError, OSError):
        return None


def releasers() -> dict[str, Callable[[], None]]:
    """The release calls this process's allocators offer, by name."""
    found: dict[str, Callable[[], None]] = {}
    trim = _global_symbol("malloc_trim")
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
        found["malloc_trim"] = lambda: trim(0)
    tcmalloc = _global_symbol("MallocExtension_ReleaseFreeMemory")
    if tcmalloc is not None:
        tcmalloc.argtypes, tcmalloc.restype = [], None
        found["tcmalloc"] = lambda: tcmalloc()
    return found


def release_free_memory(what: str) -> Release | None:
    """Return freed heap memory to the OS and log RssAnon before/after; None if disabled or impossible."""
    if not release_enabled():
        return None
    calls = releasers()
    if not calls:
        return None
    pid = os.getpid()
    before = rss_anon_bytes(pid)
    for call in calls.values():
        call()
    after = rss_anon_bytes(pid)
    _LOG.info(
        "spark-edge: released free heap memory after %s (%s): RssAnon %d MiB -> %d MiB",
        what,
        "+".join(calls),
        before // _MIB,
        after // _MIB,
    )
    return Release(what, before, after, tuple(calls))
