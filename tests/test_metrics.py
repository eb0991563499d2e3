"""spark-edge's Prometheus collector, without an engine."""

from __future__ import annotations

import json
import mmap
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from spark_edge.environment import RUN_DIR
from spark_edge.metrics.process_tree import SERVING_INTERVAL_S, SERVING_RESCAN_S, TreeRssSampler, tree_cpu_seconds
from spark_edge.metrics.prometheus import (
    MISS_REASONS,
    ServerFacts,
    SparkEdgeCollector,
    compile_cache_counts,
    install,
    read_events,
)
from spark_edge.runtime import compile_cache, fixes
from spark_edge.runtime.compile_cache import EVENTS_FILE, HIT, MISS

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _facts(run_dir: Path | None) -> ServerFacts:
    return ServerFacts(
        "avx512",
        "w4a16",
        "0.1.0",
        "0.32.0",
        8 << 30,
        run_dir,
        {"probe": 0.01, "ready": 12.5},
        load_peak_bytes=300 << 20,
        max_model_len=1024,
        requested_max_model_len=4096,
        plan_steady_bytes=1900 << 20,
        plan_file_backed_bytes=270 << 20,
        plan_load_peak_bytes=1950 << 20,
        plan_peak_bytes=2200 << 20,
    )


def _samples(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


@pytest.fixture
def sampler() -> Iterator[TreeRssSampler]:
    sampler = TreeRssSampler(os.getpid(), interval_s=0.01).start()
    time.sleep(0.05)
    yield sampler
    sampler.stop()


def _registry(collector: SparkEdgeCollector) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(collector)
    return registry


def _scrape(collector: SparkEdgeCollector) -> Samples:
    return _samples(generate_latest(_registry(collector)).decode())


def test_events_file_tolerates_a_torn_line(tmp_path: Path) -> None:
    (tmp_path / EVENTS_FILE).write_text('{"event": "compile_cache_miss"}\n{"event": "compile_cache_hit"}\n{"ev')
    assert [e["event"] for e in read_events(tmp_path)] == ["compile_cache_miss", "compile_cache_hit"]
    assert read_events(tmp_path / "absent") == [] and read_events(None) == []


def test_misses_are_counted_per_reason_from_zero() -> None:
    events = [
        {"event": HIT},
        {"event": MISS, "reason": "no_artifact"},
        {"event": MISS, "reason": "no_artifact"},
        {"event": MISS, "reason": "from_a_newer_runtime"},
        {"event": MISS},
        {"event": "other"},
    ]
    hits, misses = compile_cache_counts(events)
    assert hits == 1
    assert misses == {
        **{reason: 0 for reason in MISS_REASONS},
        "no_artifact": 2,
        "from_a_newer_runtime": 1,
        "unknown": 1,
    }


def test_collector_exposes_every_series_with_prometheus_names(tmp_path: Path, sampler: TreeRssSampler) -> None:
    events = [{"event": MISS, "reason": "no_artifact"}, {"event": HIT}, {"event": HIT}]
    (tmp_path / EVENTS_FILE).write_text("".join(json.dumps(e) + "\n" for e in events))
    samples = _scrape(SparkEdgeCollector(_facts(tmp_path), sampler))
    assert samples[("spark_edge_compile_cache_hits_total", ())] == 2
    assert samples[("spark_edge_compile_cache_misses_total", (("reason", "no_artifact"),))] == 1
    assert samples[("spark_edge_compile_cache_misses_total", (("reason", "stamp_mismatch"),))] == 0
    assert samples[("spark_edge_memory_limit_bytes", ())] == 8 << 30
    assert samples[("spark_edge_load_rss_anon_peak_bytes", ())] == 300 << 20
    assert samples[("spark_edge_max_model_len_tokens", ())] == 1024  # the plan reduced what was asked
    assert samples[("spark_edge_requested_max_model_len_tokens", ())] == 4096
    assert samples[("spark_edge_plan_steady_bytes", ())] == 1900 << 20
    assert samples[("spark_edge_plan_file_backed_bytes", ())] == 270 << 20
    assert samples[("spark_edge_plan_load_peak_bytes", ())] == 1950 << 20
    assert samples[("spark_edge_plan_peak_bytes", ())] == 2200 << 20
    assert (
        samples[("spark_edge_process_rss_anon_peak_bytes", ())]
        >= samples[("spark_edge_process_rss_anon_bytes", ())]
        > 0
    )
    assert samples[("spark_edge_startup_seconds", (("phase", "ready"),))] == 12.5
    info = (("isa", "avx512"), ("version", "0.1.0"), ("vllm_version", "0.32.0"), ("weight_path", "w4a16"))
    assert samples[("spark_edge_build_info", info)] == 1
    assert samples[("spark_edge_process_cpu_seconds_total", ())] > 0  # this test's own process tree
    # Prometheus computes rates: no gauge of one
    assert not [name for name, _ in samples if "per_second" in name]


def test_exposition_follows_prometheus_naming(tmp_path: Path, sampler: TreeRssSampler) -> None:
    text = generate_latest(_registry(SparkEdgeCollector(_facts(tmp_path), sampler))).decode()
    for family in text_string_to_metric_families(text):
        if family.type == "counter":
            assert all(s.name.endswith("_total") for s in family.samples), family.name
        assert not family.name.endswith(("_per_second", "_rate")), family.name
        assert family.type in ("counter", "gauge") and family.documentation, family.name


def test_describe_announces_what_collect_exposes_without_reading_state(tmp_path: Path, sampler: TreeRssSampler) -> None:
    collector = SparkEdgeCollector(_facts(tmp_path), sampler)
    described = [(f.name, f.type, f.documentation) for f in collector.describe()]
    collected = [(f.name, f.type, f.documentation) for f in collector.collect()]
    assert described == collected
    assert all(not f.samples for f in collector.describe())

    def no_scrape() -> dict:
        raise AssertionError("registering must not collect")

    collector._values = no_scrape  # an auto-describing registry (as REGISTRY is) calls collect() without describe()
    CollectorRegistry(auto_describe=True).register(collector)


def test_runtime_misses_are_exported_with_their_reason(
    tmp_path: Path, sampler: TreeRssSampler, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reasons come from the runtime's own recording paths, not from hand-written events."""
    run_dir = tmp_path / "run"
    monkeypatch.setenv(RUN_DIR.name, str(run_dir))
    root = tmp_path / "vllm-cache"
    compile_cache.prepare_cache_root(root, {"weight_path": "bf16"})
    (root / "leftover").write_text("compiled for bf16")
    compile_cache.prepare_cache_root(root, {"weight_path": "w4a16"})  # built for another path: emptied
    load = fixes.count_compile_cache_loads(lambda model, aot_compilation_path: None)
    load(None, aot_compilation_path=str(tmp_path / "absent"))  # vLLM finds no artifact and compiles
    samples = _scrape(SparkEdgeCollector(_facts(run_dir), sampler))
    misses = {
        labels[0][1]: value
        for (name, labels), value in samples.items()
        if name == "spark_edge_compile_cache_misses_total"
    }
    assert misses == {**{reason: 0 for reason in MISS_REASONS}, "stamp_mismatch": 1, "no_artifact": 1}


def _vllm_metrics_page() -> str:
    """GET /metrics of an app on which vLLM mounted its metrics, as its API server does."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from vllm.entrypoints.serve.instrumentator.metrics import attach_router

    app = FastAPI()
    attach_router(app)
    response = TestClient(app).get("/metrics")
    assert response.status_code == 200
    return response.text


@pytest.mark.parametrize("multiprocess", [False, True], ids=["one-process", "PROMETHEUS_MULTIPROC_DIR"])
def test_vllm_metrics_page_serves_our_series_unless_multiprocess(
    multiprocess: bool,
    tmp_path: Path,
    sampler: TreeRssSampler,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    if multiprocess:
        monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    else:
        monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    threads = threading.active_count()
    collector = install(_facts(None), sampler)
    try:
        assert threading.active_count() == threads, "the collector needs no thread"
        samples = _samples(_vllm_metrics_page())
    finally:
        REGISTRY.unregister(collector)
    if multiprocess:  # vLLM answers from the multiprocess files only: said at start
        assert not [name for name, _ in samples if name.startswith("spark_edge_")]
        assert "PROMETHEUS_MULTIPROC_DIR is set" in caplog.text
    else:
        assert samples[("spark_edge_memory_limit_bytes", ())] == 8 << 30
        assert samples[("spark_edge_compile_cache_misses_total", (("reason", "no_artifact"),))] == 0
        assert ("process_start_time_seconds", ()) in samples  # the restart alert's series, beside ours
        assert "PROMETHEUS_MULTIPROC_DIR" not in caplog.text


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


def test_the_rss_gauge_is_sampled_at_scrape_time_between_slow_samples() -> None:
    sampler = TreeRssSampler(os.getpid(), interval_s=3600, rescan_s=3600).start()
    time.sleep(0.05)  # the first sample (and listing) is taken at start
    first = sampler.current
    # 64 MiB of new anonymous pages, touched: mapped privately rather than malloc'd, which may hand back
    # pages already resident (freed heap of earlier tests in this process, seen as no growth at all)
    block = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE)
    for i in range(0, len(block), 4096):
        block[i] = 1
    now = sampler.sample()
    assert now - first >= 48 << 20 and sampler.current == now and sampler.peak >= now
    block.close()
    sampler.stop()


def test_a_child_that_has_not_exec_ed_yet_is_not_counted_twice() -> None:
    """Between fork and exec a child shows its parent's anonymous pages; the tree's sum counts them once (a
    single-layout server spawning compilers otherwise showed a peak above its own cgroup limit)."""
    import os
    import time

    from spark_edge.metrics.process_tree import tree_rss_anon_bytes
    from spark_edge.probe.procfs import rss_anon_bytes

    ballast = bytearray(64 << 20)  # noqa: F841 (resident: the parent's pages the child shares)
    for i in range(0, len(ballast), 4096):
        ballast[i] = 1
    child = os.fork()
    if child == 0:  # the child never execs: it sleeps with the parent's pages, then leaves
        time.sleep(5)
        os._exit(0)
    try:
        time.sleep(0.2)
        parent = rss_anon_bytes(os.getpid())
        assert rss_anon_bytes(child) >= 64 << 20  # what a plain sum would have counted again
        assert tree_rss_anon_bytes([os.getpid(), child]) <= parent + (8 << 20)
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)
