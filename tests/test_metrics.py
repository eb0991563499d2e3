"""spark-edge's Prometheus collector, without an engine."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from spark_edge.metrics.process_tree import SERVING_INTERVAL_S, SERVING_RESCAN_S, TreeRssSampler, tree_cpu_seconds
from spark_edge.metrics.prometheus import DecodeRate, ServerFacts, SparkEdgeCollector, read_events
from spark_edge.runtime.compile_cache import EVENTS_FILE


class _FakeItl:
    def __init__(self) -> None:
        self.count, self.sum = 0.0, 0.0

    def __call__(self) -> tuple[float, float]:
        return self.count, self.sum


def test_decode_rate_is_tokens_over_decode_seconds_and_survives_idle() -> None:
    itl = _FakeItl()
    rate = DecodeRate(itl, window_s=10, interval_s=0.02).start()
    try:
        itl.count, itl.sum = 50.0, 1.0  # 50 tokens in 1 s of decoding
        time.sleep(0.1)
        assert abs(rate.tokens_per_second - 50) < 1e-6
        itl.count, itl.sum = 70.0, 2.0  # 20 more tokens in 1 more second: 70 over 2 s
        time.sleep(0.1)
        assert abs(rate.tokens_per_second - 35) < 1e-6
        time.sleep(0.1)  # idle: no change, the rate stays
        assert abs(rate.tokens_per_second - 35) < 1e-6
    finally:
        rate.stop()


def test_events_file_tolerates_a_torn_line(tmp_path: Path) -> None:
    (tmp_path / EVENTS_FILE).write_text('{"event": "compile_cache_miss"}\n{"event": "compile_cache_hit"}\n{"ev')
    assert [e["event"] for e in read_events(tmp_path)] == ["compile_cache_miss", "compile_cache_hit"]
    assert read_events(tmp_path / "absent") == [] and read_events(None) == []


def test_collector_exposes_every_series_with_prometheus_names(tmp_path: Path) -> None:
    events = [{"event": "compile_cache_miss"}, {"event": "compile_cache_hit"}, {"event": "compile_cache_hit"}]
    (tmp_path / EVENTS_FILE).write_text("".join(json.dumps(e) + "\n" for e in events))
    facts = ServerFacts("avx512", "w4a16", "0.1.0", "0.32.0", 8 << 30, tmp_path, {"probe": 0.01, "ready": 12.5},
                        load_peak_bytes=300 << 20, max_model_len=1024, requested_max_model_len=4096,
                        plan_steady_bytes=1900 << 20, plan_load_peak_bytes=1950 << 20,
                        plan_peak_bytes=2200 << 20)
    sampler = TreeRssSampler(os.getpid(), interval_s=0.01).start()
    rate = DecodeRate(_FakeItl(), interval_s=0.01)
    time.sleep(0.05)
    registry = CollectorRegistry()
    registry.register(SparkEdgeCollector(facts, sampler, rate))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}
    sampler.stop()
    assert samples[("spark_edge_compile_cache_hits_total", ())] == 2
    assert samples[("spark_edge_compile_cache_misses_total", ())] == 1
    assert samples[("spark_edge_memory_limit_bytes", ())] == 8 << 30
    assert samples[("spark_edge_load_rss_anon_peak_bytes", ())] == 300 << 20
    assert samples[("spark_edge_max_model_len_tokens", ())] == 1024  # the plan reduced what was asked
    assert samples[("spark_edge_requested_max_model_len_tokens", ())] == 4096
    assert samples[("spark_edge_plan_steady_bytes", ())] == 1900 << 20
    assert samples[("spark_edge_plan_load_peak_bytes", ())] == 1950 << 20
    assert samples[("spark_edge_plan_peak_bytes", ())] == 2200 << 20
    assert samples[("spark_edge_process_rss_anon_peak_bytes", ())] >= samples[("spark_edge_process_rss_anon_bytes", ())] > 0
    assert samples[("spark_edge_startup_seconds", (("phase", "ready"),))] == 12.5
    info = (("isa", "avx512"), ("version", "0.1.0"), ("vllm_version", "0.32.0"), ("weight_path", "w4a16"))
    assert samples[("spark_edge_build_info", info)] == 1
    assert samples[("spark_edge_generation_tokens_per_second", ())] == 0
    assert samples[("spark_edge_process_cpu_seconds_total", ())] > 0  # this test's own process tree


def test_the_tree_cpu_counter_grows_with_work_and_the_sampler_slows_once_ready() -> None:
    sampler = TreeRssSampler(os.getpid(), interval_s=0.01, rescan_s=0.01).start()
    time.sleep(0.05)
    before = tree_cpu_seconds(sampler.pids)
    end = time.process_time() + 0.2
    while time.process_time() < end:  # 0.2 s of this process's CPU
        pass
    assert tree_cpu_seconds(sampler.pids) - before >= 0.15
    sampler.set_pace(SERVING_INTERVAL_S, SERVING_RESCAN_S)
    assert (sampler.interval_s, sampler.rescan_s) == (SERVING_INTERVAL_S, SERVING_RESCAN_S)
    sampler.stop()  # wakes the slowed sampler at once: it waits on its stop event
