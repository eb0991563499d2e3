"""`spark-edge bench --load`, short: 4 streaming clients for 20 s against the session's bf16 server.

Asserts what must hold under load, never how fast: no request fails, the server logs no 5xx,
anonymous RSS stays under the memory plan, and the report carries TTFT percentiles and throughput.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from spark_edge.bench.load import LoadReport, MiB, format_load_table, rss_slope
from spark_edge.bench.streams import percentile

from conftest import Server

pytestmark = pytest.mark.engine

CLIENTS, DURATION_S, MAX_TOKENS = 4, 20, 32
SERVER_ERROR = re.compile(rb'HTTP/1\.[01]" 5\d\d ')


def test_bounded_load_has_no_errors_and_stays_under_the_plan(bf16_server: Server, tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    errors_before = len(SERVER_ERROR.findall(bf16_server.log_path.read_bytes()))
    cmd = [
        sys.executable,
        "-m",
        "spark_edge.cli",
        "bench",
        "--load",
        "--url",
        bf16_server.url,
        "--clients",
        str(CLIENTS),
        "--duration",
        str(DURATION_S),
        "--max-tokens",
        str(MAX_TOKENS),
        "--out",
        str(out),
    ]
    env = {**os.environ, "SPARK_EDGE_API_KEY": bf16_server.api_key or ""}
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=DURATION_S + 300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "TTFT p50" in run.stdout and "TTFT p95" in run.stdout  # the table

    report = json.loads(out.read_text())["load"][bf16_server.url]
    print(run.stdout)
    assert report["errors"] == []
    assert report["requests"] >= CLIENTS and report["tokens"] == report["requests"] * MAX_TOKENS
    assert 0 < report["ttft_p50_s"] <= report["ttft_p95_s"]
    assert report["throughput_tps"] > 0 and report["stream_tps_p50"] > 0
    assert 0 < report["rss_anon_max_bytes"] <= report["plan_steady_bytes"], report
    assert report["rss_anon_peak_bytes"] <= report["plan_peak_bytes"], report
    assert report["under_plan"] is True
    assert len(SERVER_ERROR.findall(bf16_server.log_path.read_bytes())) == errors_before
    assert bf16_server.api_key not in bf16_server.log_path.read_text(errors="replace")


def test_load_table_flags_errors_and_rss_over_the_plan() -> None:
    report = LoadReport(
        url="http://x",
        clients=2,
        duration_s=5,
        wall_s=5.5,
        max_tokens=8,
        prompt_words=4,
        requests=3,
        errors=["HTTP 500: boom"],
        tokens=16,
        ttft_p50_s=0.1,
        ttft_p95_s=0.2,
        throughput_tps=2.9,
        stream_tps_p50=20.0,
        rss_anon_max_bytes=2100 << 20,
        rss_anon_peak_bytes=2200 << 20,
        plan_steady_bytes=2000 << 20,
        plan_peak_bytes=2300 << 20,
        memory_limit_bytes=4 << 30,
    )
    assert not report.under_plan  # the steady figure was exceeded during the load
    table = format_load_table({"bf16": report})
    assert "OVER" in table and "bf16: error: HTTP 500: boom" in table
    assert report.as_dict()["under_plan"] is False and "samples" not in report.as_dict()
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0


def test_rss_slope_reads_the_last_window_only() -> None:
    # flat for 10 minutes, then +1 MiB a minute for 20: the window sees only the growth
    series = [(float(t), 1000 << 20) for t in range(0, 600, 10)]
    series += [(float(t), (1000 << 20) + (t - 600) * MiB // 60) for t in range(600, 1801, 10)]
    slope, covered = rss_slope(series)
    assert abs(slope - 60.0) < 0.5 and covered == 1200
    assert rss_slope(series, window_s=100000)[0] < 60.0  # the flat start pulls the whole run's slope down
    assert rss_slope(series[:1]) == (0.0, 0.0)
