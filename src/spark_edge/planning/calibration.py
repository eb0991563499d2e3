"""The memory plan's runtime baseline, calibrated per host by the server's own measurement.

The baseline (imports, thread pools, allocator arenas, oneDNN scratch, the compiled graph) is a
constant measured on one host; on another it differs (an AMD Zen 4 host's load peak ran 12-14% above
a plan calibrated on an Intel AMX host). So when a server is ready, `serve` (and `warm`) records what
the baseline must have been for the plan's load peak to equal the measured one, and later plans on
the same host take the larger of the constant and that record: the plan becomes an upper bound on the
host it runs on, from its second start (or after `spark-edge warm`, as the images do).

A record is kept in the data folder per host kind and setup: the ISA features, the machine, torch's
and vLLM's versions, the weight path and the process layout (a key of them names the file), so a
record is never applied to another CPU or another software stack. Records only grow (a peak seen once
can be seen again), and never below the constant.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path

from spark_edge.paths import spark_edge_home
from spark_edge.planning.memory_plan import MemoryPlan
from spark_edge.runtime.compile_cache import cache_stamp

CALIBRATION_DIR = "calibration"


def _key(features: list[str], weight_path: str, layout: str) -> str:
    stamp = {**cache_stamp(features, weight_path), "layout": layout}
    stamp.pop("schema", None)
    return hashlib.sha256(json.dumps(stamp, sort_keys=True).encode()).hexdigest()[:16]


def _path(features: list[str], weight_path: str, layout: str) -> Path:
    return spark_edge_home() / CALIBRATION_DIR / f"{weight_path}-{layout}-{_key(features, weight_path, layout)}.json"


def calibrated_baseline(features: list[str], weight_path: str, layout: str) -> int | None:
    """The recorded baseline for this host and setup, or None (none recorded, or unreadable)."""
    try:
        record = json.loads(_path(features, weight_path, layout).read_text())
        return int(record["baseline_bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def record_load_peak(
    features: list[str], plan: MemoryPlan, layout: str, measured_load_peak: int, cpu_model: str | None
) -> int:
    """Record the baseline that makes `plan`'s load peak equal the measured one (if larger than the one
    recorded); returns the baseline now in force. Best effort: a read-only data folder keeps the constant."""
    needed = plan.baseline_bytes + measured_load_peak - plan.load_peak_bytes
    current = calibrated_baseline(features, plan.weight_path, layout) or 0
    if needed <= current:
        return current
    path = _path(features, plan.weight_path, layout)
    record = {
        "baseline_bytes": needed,
        "measured_load_peak_bytes": measured_load_peak,
        "plan_load_peak_bytes": plan.load_peak_bytes,
        "cpu_model": cpu_model,
        "machine": platform.machine(),
        "recorded": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError:
        return current
    return needed
