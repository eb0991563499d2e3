"""A bounded load test: N concurrent streaming clients against one server, for a fixed time.

Each client sends streaming completions back to back until the time is up (a request started
before then runs to its end): a prompt of random words (so vLLM's prefix cache never serves a
repeat) and a fixed number of tokens to generate, end-of-sequence ignored. Measured per request:
time to first token (request sent to first token received) and the tokens received; an error
is any request that does not end with HTTP 200, every token asked for and the final [DONE].
While the clients run, /metrics is scraped every second for the server's anonymous RSS (the
process tree's, spark-edge's own series), compared at the end with the memory plan's figures,
which the server also publishes.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import requests
from prometheus_client.parser import text_string_to_metric_families

from spark_edge.bench.streams import percentile

MiB = 1 << 20
SLOPE_WINDOW_S = 1200  # a soak's last 20 minutes: allocator arenas and caches have settled by then
# Common English words: prompts that tokenize to about one token per word.
_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who oil its now find long down day did "
    "get come made may part"
).split()


@dataclass
class RequestResult:
    ttft_s: float | None
    tokens: int
    seconds: float  # request sent to stream end
    error: str | None = None


@dataclass
class LoadReport:
    url: str
    clients: int
    duration_s: float  # asked for
    wall_s: float  # first request sent to last stream ended
    max_tokens: int
    prompt_words: int
    requests: int
    errors: list[str]
    tokens: int
    ttft_p50_s: float
    ttft_p95_s: float
    throughput_tps: float  # tokens received by all clients per wall second
    stream_tps_p50: float  # per request: tokens after the first over the time after the first
    rss_anon_max_bytes: int  # the highest spark_edge_process_rss_anon_bytes scraped during the load
    rss_anon_peak_bytes: int  # spark_edge_process_rss_anon_peak_bytes at the end (whole life, load included)
    plan_steady_bytes: int
    plan_peak_bytes: int  # the plan's highest: its load peak or a prompt_logprobs step
    memory_limit_bytes: int
    # least-squares slope of the tree's anonymous RSS over the load's last SLOPE_WINDOW_S (all of it if shorter)
    rss_slope_mib_per_hour: float = 0.0
    rss_slope_window_s: float = 0.0
    samples: list[RequestResult] = field(default_factory=list, repr=False)

    @property
    def under_plan(self) -> bool:
        """Anonymous RSS stayed within the plan: its steady figure during load, its peak over the life."""
        return self.rss_anon_max_bytes <= self.plan_steady_bytes and self.rss_anon_peak_bytes <= self.plan_peak_bytes

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("samples")
        d["under_plan"] = self.under_plan
        return d


def scrape(url: str) -> dict[str, float]:
    """Unlabelled samples of /metrics (spark-edge's gauges and counters are unlabelled)."""
    text = requests.get(f"{url}/metrics", timeout=30).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def served_model(url: str, headers: dict[str, str]) -> str:
    reply = requests.get(f"{url}/v1/models", headers=headers, timeout=30)
    reply.raise_for_status()
    return reply.json()["data"][0]["id"]


def stream_one(url: str, headers: dict[str, str], body: dict, timeout_s: float) -> RequestResult:
    start = time.perf_counter()
    ttft, tokens, done = None, 0, False
    try:
        with requests.post(
            f"{url}/v1/completions", json=body, headers=headers, stream=True, timeout=timeout_s
        ) as reply:
            if reply.status_code != 200:
                return RequestResult(
                    None, 0, time.perf_counter() - start, f"HTTP {reply.status_code}: {reply.text[:200]}"
                )
            for line in reply.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                data = line[6:]
                if data == b"[DONE]":
                    done = True
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    return RequestResult(ttft, tokens, time.perf_counter() - start, f"stream error: {chunk['error']}")
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    tokens += 1
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]  # the server's count wins
    except (requests.RequestException, ValueError) as exc:
        return RequestResult(ttft, tokens, time.perf_counter() - start, f"{type(exc).__name__}: {exc}")
    seconds = time.perf_counter() - start
    if not done or tokens != body["max_tokens"]:
        return RequestResult(
            ttft,
            tokens,
            seconds,
            f"stream ended early: {tokens}/{body['max_tokens']} tokens, [DONE] {'seen' if done else 'missing'}",
        )
    return RequestResult(ttft, tokens, seconds)


def rss_slope(series: list[tuple[float, int]], window_s: float = SLOPE_WINDOW_S) -> tuple[float, float]:
    """(MiB per hour, seconds covered): least squares over the series' last `window_s` seconds."""
    tail = [(t, b) for t, b in series if series and t >= series[-1][0] - window_s]
    if len(tail) < 2 or tail[-1][0] == tail[0][0]:
        return 0.0, 0.0
    mean_t = sum(t for t, _ in tail) / len(tail)
    mean_b = sum(b for _, b in tail) / len(tail)
    slope = sum((t - mean_t) * (b - mean_b) for t, b in tail) / sum((t - mean_t) ** 2 for t, _ in tail)
    return slope * 3600 / MiB, tail[-1][0] - tail[0][0]


class _RssWatch:
    """Scrapes the server's anonymous RSS every second while the load runs."""

    def __init__(self, url: str, interval_s: float = 1.0):
        self.url, self.interval_s = url, interval_s
        self.max_bytes = 0
        self.series: list[tuple[float, int]] = []  # (monotonic s, bytes)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-watch", daemon=True)

    def __enter__(self) -> _RssWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            try:
                value = int(scrape(self.url).get("spark_edge_process_rss_anon_bytes", 0))
                self.max_bytes = max(self.max_bytes, value)
                self.series.append((time.monotonic(), value))
            except requests.RequestException as exc:
                self.errors.append(f"/metrics: {exc}")
            if self._stop.wait(self.interval_s):
                return


def run_load(
    url: str,
    clients: int,
    duration_s: float,
    max_tokens: int = 64,
    prompt_words: int = 128,
    api_key: str | None = None,
    seed: int = 0,
    request_timeout_s: float = 300,
    log: Callable[[str], None] = lambda msg: None,
) -> LoadReport:
    """Run the load against a ready server at `url` and report it (errors are counted, not raised)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    model = served_model(url, headers)
    results: list[RequestResult] = []
    lock = threading.Lock()

    def client(index: int, deadline: float) -> None:
        rng = random.Random(seed * 1000 + index)
        while time.monotonic() < deadline:
            prompt = " ".join(rng.choice(_WORDS) for _ in range(prompt_words))
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0.8,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            result = stream_one(url, headers, body, request_timeout_s)
            with lock:
                results.append(result)

    log(
        f"load: {clients} streaming clients for {duration_s:.0f} s against {url} ({model}), "
        f"{prompt_words}-word prompts, {max_tokens} tokens each"
    )
    with _RssWatch(url) as watch:
        start = time.monotonic()
        threads = [threading.Thread(target=client, args=(i, start + duration_s), daemon=True) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - start
    end = scrape(url)
    ok = [r for r in results if r.error is None]
    errors = [r.error for r in results if r.error is not None] + watch.errors
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    slope, covered = rss_slope(watch.series)
    stream_rates = [
        (r.tokens - 1) / (r.seconds - r.ttft_s)
        for r in ok
        if r.ttft_s is not None and r.tokens > 1 and r.seconds > r.ttft_s
    ]
    return LoadReport(
        url=url,
        clients=clients,
        duration_s=duration_s,
        wall_s=wall,
        max_tokens=max_tokens,
        prompt_words=prompt_words,
        requests=len(results),
        errors=errors,
        tokens=sum(r.tokens for r in results),
        ttft_p50_s=percentile(ttfts, 0.5) if ttfts else 0.0,
        ttft_p95_s=percentile(ttfts, 0.95) if ttfts else 0.0,
        throughput_tps=sum(r.tokens for r in results) / wall if wall > 0 else 0.0,
        stream_tps_p50=percentile(stream_rates, 0.5) if stream_rates else 0.0,
        rss_anon_max_bytes=max(watch.max_bytes, int(end.get("spark_edge_process_rss_anon_bytes", 0))),
        rss_anon_peak_bytes=int(end.get("spark_edge_process_rss_anon_peak_bytes", 0)),
        plan_steady_bytes=int(end.get("spark_edge_plan_steady_bytes", 0)),
        plan_peak_bytes=int(end.get("spark_edge_plan_peak_bytes", 0)),
        memory_limit_bytes=int(end.get("spark_edge_memory_limit_bytes", 0)),
        rss_slope_mib_per_hour=slope,
        rss_slope_window_s=covered,
        samples=results,
    )


def format_load_table(reports: dict[str, LoadReport]) -> str:
    width = max([12, *(len(tag) for tag in reports)])
    head = (
        f"{'arm':<{width}} {'clients':>7} {'requests':>8} {'errors':>6} {'TTFT p50':>9} {'TTFT p95':>9} "
        f"{'tok/s':>7} {'stream tok/s':>12} {'RSS max MiB':>11} {'plan MiB':>9} {'peak/plan peak':>15} "
        f"{'RSS MiB/h':>9}"
    )
    lines = [head, "-" * len(head)]
    for tag, r in reports.items():
        lines.append(
            f"{tag:<{width}} {r.clients:>7} {r.requests:>8} {len(r.errors):>6} "
            f"{r.ttft_p50_s:>8.3f}s {r.ttft_p95_s:>8.3f}s "
            f"{r.throughput_tps:>7.1f} {r.stream_tps_p50:>12.1f} {r.rss_anon_max_bytes / MiB:>11.0f} "
            f"{r.plan_steady_bytes / MiB:>9.0f} "
            f"{r.rss_anon_peak_bytes / MiB:>6.0f}/{r.plan_peak_bytes / MiB:<6.0f} {r.rss_slope_mib_per_hour:>+9.1f}"
            f"{'' if r.under_plan else ' OVER'}"
        )
    for tag, r in reports.items():
        for error in r.errors[:5]:
            lines.append(f"{tag}: error: {error}")
    lines.append(
        "RSS max: anonymous RSS of the server's process tree during the load (plan: its steady figure); "
        "peak: over the server's life, load included (plan: its peak, load or a prompt_logprobs step); "
        f"RSS MiB/h: its least-squares slope over the load's last {SLOPE_WINDOW_S // 60} minutes "
        "(all of a shorter load)"
    )
    return "\n".join(lines)
