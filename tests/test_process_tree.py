"""Anonymous RSS over a process tree, and the sampler's peak."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from spark_edge.metrics.process_tree import (
    TreeRssSampler,
    process_age_seconds,
    process_tree,
    rss_anon_bytes,
    tree_rss_anon_bytes,
)

MiB = 1 << 20

# A parent that starts a child; the child touches 200 MiB, reports, then frees it and waits.
_CHILD = (
    "import sys,time; b=bytearray(200<<20); print('full', flush=True); sys.stdin.readline(); del b; "
    "print('freed', flush=True); time.sleep(60)"
)
_PARENT = f"import subprocess,sys; p=subprocess.Popen([sys.executable,'-c',{_CHILD!r}]); p.wait()"


def test_tree_sum_sees_a_grandchild_and_the_sampler_keeps_its_peak() -> None:
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "full"
        tree = process_tree(parent.pid)
        assert len(tree) == 2 and tree[0] == parent.pid
        child = tree[1]
        assert rss_anon_bytes(child) >= 200 * MiB
        assert tree_rss_anon_bytes(tree) >= rss_anon_bytes(child) + rss_anon_bytes(parent.pid)
        sampler = TreeRssSampler(parent.pid, interval_s=0.01, rescan_s=0.05).start()
        time.sleep(0.2)
        peak_full = sampler.peak
        parent.stdin.write("\n")
        parent.stdin.flush()
        assert parent.stdout.readline().strip() == "freed"
        time.sleep(0.3)
        sampler.stop()
        assert peak_full >= 200 * MiB
        assert sampler.peak >= peak_full
        assert sampler.current < 100 * MiB  # the child returned its 200 MiB
    finally:
        for pid in process_tree(parent.pid)[1:]:
            subprocess.run(["kill", str(pid)])
        parent.kill()
        parent.wait()


def test_a_vanished_process_counts_zero() -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert rss_anon_bytes(p.pid) == 0


def test_a_process_age_counts_from_its_start() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        time.sleep(0.5)
        assert 0.4 <= process_age_seconds(child.pid) < 3
        assert process_age_seconds(os.getpid()) > process_age_seconds(child.pid)
    finally:
        child.kill()
        child.wait()
    assert process_age_seconds(child.pid) == 0.0  # gone
