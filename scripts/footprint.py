#!/usr/bin/env python3
"""Where a served model's memory baseline goes: anonymous RSS per import stage and per package, in fresh
interpreters, and per process of a running server. Writes docs/footprint.md (issue #21's table), naming the host.

    .venv/bin/python scripts/footprint.py [--url http://127.0.0.1:8000 --what "default model, w4a16"]
                                          [--idle-seconds 60]

Each figure is RssAnon of a fresh `python -c "import ..."` (what the import itself allocates, shared
libraries' text not counted), so rows of one table are comparable; a running server's processes hold more
(the model, the KV cache, compiled graphs, allocator arenas). With --url, the server's process tree is read
from /proc (the listening process and its children): run it on the host that serves.
Idle CPU: one request, 10 s of quiet, then every thread's CPU time over --idle-seconds, by process and
thread name.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from spark_edge.metrics.process_tree import process_tree, rss_anon_bytes  # noqa: E402
from spark_edge.probe.cpu_features import first_processor_fields  # noqa: E402

MiB = 1 << 20
# Cumulative: each stage imports what the one before did, and more.
STAGES = [
    ("python itself", "pass"),
    ("torch", "import torch"),
    ("vllm (its package root)", "import vllm"),
    ("vLLM's engine core (what the engine process runs)", "import vllm.v1.engine.core"),
    ("vLLM's OpenAI API server (what the API server process runs)", "import vllm.entrypoints.openai.api_server"),
]
# Packages the API server's import loads that CPU text serving does not use; each alone in a fresh interpreter.
PACKAGES = [
    "openai",
    "sympy",
    "networkx",
    "transformers",
    "opentelemetry.sdk.trace",
    "triton",
    "cv2",
    "PIL",
    "grpc",
    "xgrammar",
    "llguidance",
    "aiohttp",
    "tvm_ffi",
]

_PROBE = """
import re, sys, collections, json
{stmt}
status = open('/proc/self/status').read()
anon = int(re.search(r'RssAnon:\\s+(\\d+)', status).group(1)) * 1024
packages = collections.Counter(m.split('.')[0] for m in sys.modules)
print(json.dumps({{"anon": anon, "modules": len(sys.modules), "packages": packages}}))
"""


def measure(stmt: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(stmt=stmt)], capture_output=True, text=True, env=env, timeout=600
    )
    if out.returncode != 0:
        return {"anon": 0, "modules": 0, "packages": {}, "error": out.stderr.strip().splitlines()[-1:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def server_processes(url: str) -> list[tuple[int, str, int]]:
    """(pid, name, anonymous RSS) of the tree serving `url` (its listening process and children)."""
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    owner = subprocess.run(["ss", "-Hltnp", f"sport = :{port}"], capture_output=True, text=True).stdout
    match = re.search(r"pid=(\d+)", owner)
    if not match:
        raise SystemExit(f"footprint: nothing listens on port {port}")
    rows = []
    for pid in process_tree(int(match.group(1))):
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        name = (
            "engine core"
            if "EngineCore" in cmd
            else "API server"
            if " serve" in cmd
            else "a helper (multiprocessing's resource tracker)"
            if "resource_tracker" in cmd
            else cmd[:40]
        )
        rows.append((pid, name, rss_anon_bytes(pid)))
    return rows


def _thread_ticks(pid: int) -> dict[str, int]:
    """CPU ticks (user + system) per thread name of one process; names repeat, so they are summed."""
    ticks: Counter[str] = Counter()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # the thread ended while we looked
        name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        ticks[name] += int(rest[11]) + int(rest[12])  # utime, stime (fields 14 and 15)
    return dict(ticks)


def idle_cpu(url: str, seconds: float) -> tuple[float, list[tuple[str, str, float]]]:
    """Share of one core the server's tree used while idle, and (process, thread, share) rows, busiest first."""
    model = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    requests.post(f"{url}/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 16}, timeout=120)
    time.sleep(10)
    procs = server_processes(url)
    before = {(pid, name): _thread_ticks(pid) for pid, name, _ in procs}
    time.sleep(seconds)
    hz, rows = os.sysconf("SC_CLK_TCK"), []
    for (pid, name), ticks in before.items():
        for thread, used in _thread_ticks(pid).items():
            rows.append((name, thread, (used - ticks.get(thread, 0)) / hz / seconds))
    rows.sort(key=lambda row: -row[2])
    return sum(row[2] for row in rows), rows


def host() -> str:
    fields = first_processor_fields(Path("/proc/cpuinfo").read_text())
    return f"{fields.get('model name', 'unknown CPU')}, {os.cpu_count()} CPUs"


def report(url: str | None, what: str = "", idle_seconds: float = 60) -> str:
    lines = [
        "# Footprint: where the baseline goes",
        "",
        f"Generated by `scripts/footprint.py` on **{host()}** (figures are this host's). Anonymous RSS of a",
        "fresh interpreter after each import: what the import itself allocates.",
        "",
        "| import (cumulative) | anonymous RSS MiB | modules loaded |",
        "|---|---:|---:|",
    ]
    api = None
    for label, stmt in STAGES:
        m = measure(stmt)
        api = m if stmt.endswith("api_server") else api
        lines.append(f"| {label} | {m['anon'] / MiB:.0f} | {m['modules']} |")
    lines += [
        "",
        "Packages the API server's import loads, each in a fresh interpreter after torch (what it adds "
        "to torch; they share other dependencies too, so the column does not add up):",
        "",
        "| package | its modules in the API server | anonymous RSS MiB over torch |",
        "|---|---:|---:|",
    ]
    base = measure("import torch")["anon"]
    for package in PACKAGES:
        top = package.split(".")[0]
        loaded = (api or {}).get("packages", {}).get(top, 0)
        alone = measure(f"import torch; import {package}")
        lines.append(f"| `{package}` | {loaded} | {(alone['anon'] - base) / MiB:.0f} |")
    if url:
        lines += [
            "",
            f"The processes of a server ({what or url}), settled after a request:",
            "",
            "| process | anonymous RSS MiB |",
            "|---|---:|",
        ]
        rows = server_processes(url)
        for _, name, anon in rows:
            lines.append(f"| {name} | {anon / MiB:.0f} |")
        lines.append(f"| **the tree** | **{sum(anon for *_, anon in rows) / MiB:.0f}** |")
        total, threads = idle_cpu(url, idle_seconds)
        lines += [
            "",
            f"Idle: one request, 10 s of quiet, then {idle_seconds:.0f} s measured: the tree used "
            f"**{100 * total:.2f}% of one core**. Its threads that used any (CPU time per wall second):",
            "",
            "| process | thread | % of a core |",
            "|---|---|---:|",
        ]
        lines += [f"| {proc} | `{thread}` | {100 * share:.2f} |" for proc, thread, share in threads if share > 0]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running spark-edge server, to break its processes down too")
    parser.add_argument("--what", default="", help="with --url: what it serves, said in the table's heading")
    parser.add_argument("--idle-seconds", type=float, default=60, help="with --url: the idle window")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "footprint.md")
    args = parser.parse_args()
    text = report(args.url, args.what, args.idle_seconds)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
