"""spark-edge's Prometheus series, served on vLLM's own /metrics.

vLLM's single API server exposes prometheus_client's default registry, so a collector
registered there appears beside every `vllm:*` series on the same port.  Values are
computed at scrape time from state this process already holds (the RSS sampler, the
plan, startup timings) and from events vLLM's worker processes append to the run
folder (compile-cache hits and misses), so a scrape costs a few file reads.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import REGISTRY, Collector

from spark_edge.metrics.process_tree import TreeRssSampler, tree_cpu_seconds
from spark_edge.runtime import compile_cache



def read_events(run_dir: Path | None) -> list[dict]:
    """Events appended by any process of the server (compile-cache hits and misses)."""
    return [] if run_dir is None else compile_cache.read_events(run_dir)


class DecodeRate:
    """Recent decode rate per sequence: tokens over decode seconds, from vLLM's inter-token latency.

    vLLM's histogram `vllm:inter_token_latency_seconds` counts every decoded token and the
    time it took; the change in count over the change in sum, over the last `window_s`
    seconds of decoding, is the rate one stream sees.  Idle time is not decode time, so
    the gauge keeps the last busy rate instead of decaying between requests (for
    throughput, use rate() on `vllm:generation_tokens_total`).
    """

    def __init__(self, read_itl: Callable[[], tuple[float, float]], window_s: float = 10.0, interval_s: float = 1.0):
        self._read_itl = read_itl
        self._interval_s = interval_s
        self._window_s = window_s
        self._recent: deque[tuple[float, float]] = deque()  # (decode seconds, tokens) per interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="decode-rate", daemon=True)

    def start(self) -> "DecodeRate":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        last_count, last_sum = self._read_itl()
        while not self._stop.wait(self._interval_s):
            count, total = self._read_itl()
            if count > last_count:
                self._recent.append((total - last_sum, count - last_count))
                while len(self._recent) > 1 and sum(s for s, _ in self._recent) > self._window_s:
                    self._recent.popleft()
            last_count, last_sum = count, total

    @property
    def tokens_per_second(self) -> float:
        recent = list(self._recent)
        seconds = sum(s for s, _ in recent)
        return sum(t for _, t in recent) / seconds if seconds > 0 else 0.0


def vllm_inter_token_latency() -> tuple[float, float]:
    """(count, sum) of vLLM's inter-token latency histogram over its label sets; zeros before the engine exists."""
    count = total = 0.0
    for family in REGISTRY.collect():
        if family.name == "vllm:inter_token_latency_seconds":
            for sample in family.samples:
                if sample.name.endswith("_count"):
                    count += sample.value
                elif sample.name.endswith("_sum"):
                    total += sample.value
    return count, total


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
    plan_load_peak_bytes: int = 0
    plan_peak_bytes: int = 0


class SparkEdgeCollector(Collector):
    def __init__(self, facts: ServerFacts, sampler: TreeRssSampler, rate: DecodeRate):
        self.facts, self.sampler, self.rate = facts, sampler, rate

    def collect(self) -> Iterator:
        f = self.facts
        yield from self._memory(f)
        yield self._gauge("spark_edge_generation_tokens_per_second",
                          "Recent decode rate of one stream: tokens per decode second over the last 10 s of decoding",
                          self.rate.tokens_per_second)
        yield from self._compile_cache(read_events(f.run_dir))
        phases = GaugeMetricFamily("spark_edge_startup_seconds", "Seconds spent in each startup phase",
                                   labels=["phase"])
        for phase, seconds in f.startup_seconds.items():
            phases.add_metric([phase], seconds)
        yield phases
        info = GaugeMetricFamily("spark_edge_build_info", "What this server runs (always 1)",
                                 labels=["isa", "weight_path", "version", "vllm_version"])
        info.add_metric([f.isa, f.weight_path, f.version, f.vllm_version], 1)
        yield info

    @staticmethod
    def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, doc, value=value)

    def _memory(self, f: ServerFacts) -> Iterable[GaugeMetricFamily]:
        yield self._gauge("spark_edge_process_rss_anon_bytes",
                          "Anonymous RSS summed over the server's process tree", self.sampler.current)
        yield self._gauge("spark_edge_process_rss_anon_peak_bytes",
                          "Sampled high-water mark of the process tree's anonymous RSS", self.sampler.peak)
        # a counter of the whole tree's CPU time: rate() of it is the cores the server uses, idle or busy
        yield CounterMetricFamily("spark_edge_process_cpu_seconds",
                                  "User and system CPU seconds of the server's process tree",
                                  value=tree_cpu_seconds(self.sampler.pids))
        yield self._gauge("spark_edge_load_rss_anon_peak_bytes",
                          "Peak anonymous RSS of the process tree during model load and warm-up", f.load_peak_bytes)
        yield self._gauge("spark_edge_memory_limit_bytes", "The memory ceiling the plan used", f.memory_limit_bytes)
        yield self._gauge("spark_edge_plan_steady_bytes",
                          "Anonymous RSS the memory plan predicts for the process tree once loaded", f.plan_steady_bytes)
        yield self._gauge("spark_edge_plan_load_peak_bytes",
                          "Anonymous RSS the memory plan predicts for the process tree at its load peak",
                          f.plan_load_peak_bytes)
        yield self._gauge("spark_edge_plan_peak_bytes",
                          "The highest anonymous RSS the memory plan allows the process tree: its load peak or a "
                          "prompt_logprobs step, whichever is higher", f.plan_peak_bytes)
        yield self._gauge("spark_edge_max_model_len_tokens",
                          "Longest prompt plus completion this server accepts (below the requested one when the "
                          "memory plan reduced it to fit)", f.max_model_len)
        yield self._gauge("spark_edge_requested_max_model_len_tokens",
                          "The --max-model-len asked for", f.requested_max_model_len)

    @staticmethod
    def _compile_cache(events: list[dict]) -> Iterable[CounterMetricFamily]:
        counts = {"hit": 0, "miss": 0}
        for event in events:
            kind = event.get("event", "")
            if kind.startswith("compile_cache_"):
                counts[kind.removeprefix("compile_cache_")] = counts.get(kind.removeprefix("compile_cache_"), 0) + 1
        yield CounterMetricFamily("spark_edge_compile_cache_hits", "Compiled graphs loaded from the cache",
                                  value=counts["hit"])
        yield CounterMetricFamily("spark_edge_compile_cache_misses",
                                  "Compiled graphs not loadable from the cache (absent, corrupt or built for "
                                  "another ISA or version), hence compiled", value=counts["miss"])


def install(facts: ServerFacts, sampler: TreeRssSampler) -> SparkEdgeCollector:
    rate = DecodeRate(vllm_inter_token_latency).start()
    collector = SparkEdgeCollector(facts, sampler, rate)
    REGISTRY.register(collector)
    return collector
