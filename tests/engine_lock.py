"""The machine-wide engine lock: one vLLM engine, image build or container at a time on a small machine.

The same lock flock(1) takes (`flock /tmp/spark_edge_engine.lock <cmd>`), so test runs, benchmarks and
builds started by hand queue behind each other instead of sharing two cores. A run started under
`flock LOCK make test` already holds it; taking it again from a child would wait for its own parent
forever, so `engine_lock()` passes through when an ancestor holds it.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from spark_edge import environment

# SPARK_EDGE_ENGINE_LOCK= (empty) turns the lock off, e.g. on a machine with nothing else running.
ENGINE_LOCK = environment.ENGINE_LOCK.get()


def _ancestors() -> set[int]:
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat[stat.rindex(")") + 2 :].split()[1])  # ppid; the name may hold spaces
    return pids


def held_by_ancestor(lock: str) -> bool:
    """True when this process or one above it holds `lock` (an flock(2) lock, as /proc/locks lists it)."""
    try:
        st = os.stat(lock)
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return False
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    # "1: FLOCK  ADVISORY  WRITE 31772 fe:00:2146669 0 EOF"; waiters read "1: -> FLOCK ..."
    holders = {int(f[4]) for f in (line.split() for line in lines) if len(f) >= 6 and f[1] == "FLOCK" and f[5] == want}
    return bool(holders & _ancestors())


def flock_prefix() -> list[str]:
    """The argv prefix that runs a child command under the lock (empty when already held or turned off)."""
    if not ENGINE_LOCK or held_by_ancestor(ENGINE_LOCK):
        return []
    return ["flock", ENGINE_LOCK]


@contextmanager
def engine_lock() -> Iterator[None]:
    if not ENGINE_LOCK or held_by_ancestor(ENGINE_LOCK):
        yield
        return
    with open(ENGINE_LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # the same lock as flock(1): flock(2) on the file
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
