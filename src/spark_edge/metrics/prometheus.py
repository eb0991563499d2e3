"""spark-edge's Prometheus series, served on vLLM's own /metrics (vllm_registry.py says which registry that is).

Values are read at scrape time from state this process already holds (the RSS sampler, the plan,
startup timings) and from events vLLM's worker processes append to the run folder (compile-cache
hits, and misses with their reason), so a scrape costs a few file reads and no thread keeps them fresh.

Rates are PromQL's. The decode speed one stream sees is rate() of vLLM's own histogram
`vllm:inter_token_latency_seconds`: its `_count` (one per decode step of a request, i.e. per token
without speculative decoding) over its `_sum` (the seconds those steps took). spark-edge exports
neither a rate nor a copy of those counters.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from spark_edge.metrics.process_tree import TreeRssSampler, tree_cpu_seconds, tree_rss_file_bytes
from spark_edge.runtime import compile_cache

# Why a compiled graph was not loaded, as the runtime records it: per load attempt (runtime/fixes.py)
# and per cache root emptied at start (compile_cache.prepare_cache_root). Each is exported from 0, so
# a warm start has the series too; a reason not listed here is exported once seen.
MISS_REASONS = ("no_artifact", "load_failed", "altered", "stamp_mismatch", "unreadable_stamp", "unstamped_content")
UNKNOWN_REASON = "unknown"  # an event without a reason

Samples = Sequence[tuple[tuple[str, ...], float]]  # (label values, value) per series of one family


def read_events(run_dir: Path | None) -> list[dict]:
    """Events appended by any process of the server (compile-cache hits and misses)."""
    return [] if run_dir is None else compile_cache.read_events(run_dir)


def compile_cache_counts(events: Iterable[dict]) -> tuple[int, dict[str, int]]:
    """Hits, and misses per reason (every known reason present, at 0 if it never happened)."""
    hits, misses = 0, Counter({reason: 0 for reason in MISS_REASONS})
    for event in events:
        if event.get("event") == compile_cache.HIT:
            hits += 1
        elif event.get("event") == compile_cache.MISS:
            misses[str(event.get("reason") or UNKNOWN_REASON)] += 1
    return hits, dict(misses)


@dataclass
class ServerFacts:
    isa: str
    weight_path: str
    version: str
    vllm_version: str
    memory_limit_bytes: int
    run_dir: Path | None = None
    startup_seconds: dict[str, float] = field(default_factory=dict)
    load_peak_bytes: int = 0
    # from the memory plan: the context served (reduced below the one asked for when only a
    # shorter one fits under the ceiling) and the anonymous RSS it predicts
    max_model_len: int = 0
    requested_max_model_len: int = 0
    plan_steady_bytes: int = 0
    plan_file_backed_bytes: int = 0
    plan_load_peak_bytes: int = 0
    plan_peak_bytes: int = 0


@dataclass(frozen=True)
class Series:
    """One metric family: what describe() announces and collect() fills."""

    name: str  # as exposed: a counter's ends in _total
    counter: bool
    doc: str
    labels: tuple[str, ...] = ()

    def family(self, samples: Samples = ()) -> Metric:
        kind = CounterMetricFamily if self.counter else GaugeMetricFamily
        family = kind(self.name, self.doc, labels=self.labels)
        for label_values, value in samples:
            family.add_metric(list(label_values), value)
        return family


def _gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Series:
    return Series(name, False, doc, labels)


def _counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Series:
    return Series(name, True, doc, labels)


SERIES = (
    _gauge("spark_edge_process_rss_anon_bytes", "Anonymous RSS summed over the server's process tree"),
    _gauge("spark_edge_process_rss_anon_peak_bytes", "Sampled high-water mark of the process tree's anonymous RSS"),
    _gauge(
        "spark_edge_process_rss_file_bytes",
        "File-backed RSS summed over the server's process tree (mapped weights, libraries: reclaimable)",
    ),
    # the whole tree's CPU time: rate() of it is the cores the server uses, idle or busy
    _counter("spark_edge_process_cpu_seconds_total", "User and system CPU seconds of the server's process tree"),
    _gauge(
        "spark_edge_load_rss_anon_peak_bytes", "Peak anonymous RSS of the process tree during model load and warm-up"
    ),
    _gauge("spark_edge_memory_limit_bytes", "The memory ceiling the plan used"),
    _gauge(
        "spark_edge_plan_steady_bytes",
        "RSS the memory plan predicts for the process tree once loaded: anonymous plus the mapped weights",
    ),
    _gauge(
        "spark_edge_plan_file_backed_bytes",
        "The memory plan's weights, file-backed once loaded (mapped): part of its steady and peak figures",
    ),
    _gauge(
        "spark_edge_plan_load_peak_bytes",
        "RSS the memory plan predicts for the process tree at its load peak (the weights are anonymous copies then)",
    ),
    _gauge(
        "spark_edge_plan_peak_bytes",
        "The highest RSS the memory plan allows the process tree: its load peak or a prompt_logprobs step, "
        "whichever is higher",
    ),
    _gauge(
        "spark_edge_max_model_len_tokens",
        "Longest prompt plus completion this server accepts (below the requested one when the "
        "memory plan reduced it to fit)",
    ),
    _gauge("spark_edge_requested_max_model_len_tokens", "The --max-model-len asked for"),
    _counter("spark_edge_compile_cache_hits_total", "Compiled graphs loaded from the cache"),
    _counter(
        "spark_edge_compile_cache_misses_total",
        "Compiled graphs not loadable from the cache, hence compiled, by reason: no_artifact, load_failed "
        "(corrupt or incompatible), altered (failed its digests), or the cache root emptied at start because "
        "it was built for another ISA or version (stamp_mismatch, unreadable_stamp, unstamped_content)",
        ("reason",),
    ),
    _gauge(
        "spark_edge_startup_seconds",
        "Seconds spent in each startup phase: imports (process start to serve's clock), probe, checkpoint, "
        "vllm_imports, engine; ready: serve's clock to the engine ready",
        ("phase",),
    ),
    _gauge(
        "spark_edge_build_info", "What this server runs (always 1)", ("isa", "weight_path", "version", "vllm_version")
    ),
)


class SparkEdgeCollector:
    def __init__(self, facts: ServerFacts, sampler: TreeRssSampler):
        self.facts, self.sampler = facts, sampler

    def describe(self) -> Iterator[Metric]:
        """The families without reading any state: registering costs no scrape."""
        return (series.family() for series in SERIES)

    def collect(self) -> Iterator[Metric]:
        values = self._values()
        return (series.family(values[series.name]) for series in SERIES)

    def _values(self) -> dict[str, Samples]:
        f, sampler = self.facts, self.sampler
        hits, misses = compile_cache_counts(read_events(f.run_dir))
        return {
            "spark_edge_process_rss_anon_bytes": [((), sampler.sample())],
            "spark_edge_process_rss_anon_peak_bytes": [((), sampler.peak)],
            "spark_edge_process_rss_file_bytes": [((), tree_rss_file_bytes(sampler.pids))],
            "spark_edge_process_cpu_seconds_total": [((), tree_cpu_seconds(sampler.pids))],
            "spark_edge_load_rss_anon_peak_bytes": [((), f.load_peak_bytes)],
            "spark_edge_memory_limit_bytes": [((), f.memory_limit_bytes)],
            "spark_edge_plan_steady_bytes": [((), f.plan_steady_bytes)],
            "spark_edge_plan_file_backed_bytes": [((), f.plan_file_backed_bytes)],
            "spark_edge_plan_load_peak_bytes": [((), f.plan_load_peak_bytes)],
            "spark_edge_plan_peak_bytes": [((), f.plan_peak_bytes)],
            "spark_edge_max_model_len_tokens": [((), f.max_model_len)],
            "spark_edge_requested_max_model_len_tokens": [((), f.requested_max_model_len)],
            "spark_edge_compile_cache_hits_total": [((), hits)],
            "spark_edge_compile_cache_misses_total": [((reason,), n) for reason, n in sorted(misses.items())],
            "spark_edge_startup_seconds": [((phase,), s) for phase, s in f.startup_seconds.items()],
            "spark_edge_build_info": [((f.isa, f.weight_path, f.version, f.vllm_version), 1)],
        }


def install(facts: ServerFacts, sampler: TreeRssSampler) -> SparkEdgeCollector:
    """Serve spark-edge's series on vLLM's /metrics; call before vLLM builds its app."""
    from spark_edge.metrics.vllm_registry import register_where_vllm_serves

    collector = SparkEdgeCollector(facts, sampler)
    register_where_vllm_serves(collector)
    return collector
