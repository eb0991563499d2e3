"""The engine lock the tests take around vLLM engines and containers: never taken twice by one run."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from engine_lock import held_by_ancestor


def test_engine_lock_is_not_taken_twice_under_a_holder(tmp_path: Path) -> None:
    lock = tmp_path / "engine.lock"
    lock.touch()
    assert not held_by_ancestor(str(lock))
    check = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        f"from engine_lock import held_by_ancestor as held; print(held({str(lock)!r}))"
    )
    under = subprocess.run(
        ["flock", str(lock), sys.executable, "-c", check], capture_output=True, text=True, timeout=120
    )
    assert under.stdout.strip() == "True", under.stderr[-2000:]
    beside = subprocess.Popen(["flock", str(lock), "sleep", "60"])  # held, but not by an ancestor
    try:
        deadline = time.monotonic() + 10
        while str(beside.pid) not in Path("/proc/locks").read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not held_by_ancestor(str(lock))
    finally:
        beside.kill()
        beside.wait()
