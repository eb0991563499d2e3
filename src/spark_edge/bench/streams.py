"""Streaming clients against a running server: time to first token, decode rate, concurrency.

What a user of the OpenAI API sees: every figure is taken from the client side of a streamed
`/v1/completions` (server-sent events), prompts are random token ids (never a prefix-cache hit)
and `ignore_eos` makes every stream produce exactly the tokens asked for.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import requests


@dataclass
class StreamResult:
    ttft_s: float  # request sent to the first generated token received
    total_s: float  # request sent to the end of the stream
    tokens: int  # completion tokens, as the server's usage reports them

    @property
    def decode_tps(self) -> float:
        """Tokens after the first, over the time after the first."""
        return (
            (self.tokens - 1) / (self.total_s - self.ttft_s) if self.tokens > 1 and self.total_s > self.ttft_s else 0.0
        )


def random_prompt(rng: random.Random, vocab: int, n: int) -> list[int]:
    # stay clear of the special tokens at the start of the vocabulary
    return [rng.randrange(256, vocab) for _ in range(n)]


def stream_completion(
    url: str,
    model: str,
    prompt: list[int] | str,
    max_tokens: int,
    headers: dict[str, str] | None = None,
    timeout_s: float = 600,
) -> StreamResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = None
    tokens = 0
    with requests.post(
        f"{url}/v1/completions", json=body, headers=headers or {}, stream=True, timeout=timeout_s
    ) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if first is None and any(c.get("text") for c in event.get("choices", [])):
                first = time.perf_counter()
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    end = time.perf_counter()
    if tokens != max_tokens:
        raise RuntimeError(f"asked for {max_tokens} tokens, the stream reported {tokens}")
    return StreamResult((first or end) - start, end - start, tokens)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def concurrent_streams(
    url: str,
    model: str,
    vocab: int,
    streams: int,
    prompt_tokens: int,
    max_tokens: int,
    seed: int,
    headers: dict[str, str] | None = None,
) -> dict:
    """`streams` clients at once, each one streamed completion; aggregate decode throughput and TTFT."""
    rng = random.Random(seed)
    prompts = [random_prompt(rng, vocab, prompt_tokens) for _ in range(streams)]
    start = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(lambda p: stream_completion(url, model, p, max_tokens, headers), prompts))
    wall = time.perf_counter() - start
    ttfts = [r.ttft_s for r in results]
    return {
        "streams": streams,
        "aggregate_tps": sum(r.tokens for r in results) / wall,
        "per_stream_decode_tps": statistics.median(r.decode_tps for r in results),
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p95_s": percentile(ttfts, 0.95),
        "runs": [asdict(r) for r in results],
    }
