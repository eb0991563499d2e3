"""One benchmark arm: start `spark-edge serve` on a checkpoint, measure it, stop it.

Semantics follow llama-bench: prefill = a 512-token prompt generating 1 token;
decode = (1-token prompt generating 128) minus (1-token prompt generating 1), so
prefill and request overhead cancel out.  Prompts are random token ids, new for every
request, so vLLM's prefix cache never serves a repeat.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import requests

from spark_edge.bench.fidelity import score
from spark_edge.bench.grounded import grounded_decode_tps
from spark_edge.bench.streams import concurrent_streams, random_prompt, stream_completion
from spark_edge.environment import API_KEY, HOME
from spark_edge.metrics.process_tree import TreeRssSampler
from spark_edge.serving.server_process import ServerProcess, free_port, stop_group, wait_until_answers

MiB = 1 << 20


@dataclass
class ArmResult:
    tag: str
    ready_s: float  # process start to /health 200
    load_peak_bytes: int  # RssAnon over the tree, peak from start to ready
    settled_bytes: int  # RssAnon over the tree once idle after ready
    pp512_tps: float
    tg128_tps: float
    run_peak_bytes: int  # peak over the whole run, workloads included
    cache: str  # "cold" or "warm"
    metrics_scrape_s: float = 0.0  # best of 5 GETs of /metrics
    perplexity: float = 0.0  # on the fidelity text, when scored
    errors: list[str] = field(default_factory=list)
    served: dict = field(default_factory=dict)  # --served: streamed figures and concurrency
    llama_bench: dict = field(default_factory=dict)  # the llama.cpp peer: llama-bench's figures per GGUF
    top1: list[int] = field(default_factory=list, repr=False)  # teacher-forced top-1 tokens, when scored


class _Client:
    def __init__(self, url: str, model: str, vocab: int, seed: int):
        self.url, self.model, self.vocab = url, model, vocab
        self.rng = random.Random(seed)

    def _prompt(self, n: int) -> list[int]:
        return random_prompt(self.rng, self.vocab, n)

    def complete(self, n_prompt: int, n_gen: int) -> float:
        body = {
            "model": self.model,
            "prompt": self._prompt(n_prompt),
            "max_tokens": n_gen,
            "temperature": 0,
            "ignore_eos": True,
        }
        start = time.perf_counter()
        reply = requests.post(f"{self.url}/v1/completions", json=body, timeout=600)
        elapsed = time.perf_counter() - start
        reply.raise_for_status()
        got = reply.json()["usage"]["completion_tokens"]
        if got != n_gen:
            raise RuntimeError(f"asked for {n_gen} tokens, got {got}")
        return elapsed


def _timed_get(url: str) -> float:
    start = time.perf_counter()
    requests.get(url, timeout=30).raise_for_status()
    return time.perf_counter() - start


# For a server the caller launched itself (tests/test_bench_peer.py starts llama-server so): ServerProcess's
# readiness check and stop, on a bare Popen.
def _wait_ready(proc: subprocess.Popen, url: str, timeout_s: float) -> None:
    wait_until_answers(proc, f"{url}/health", timeout_s)


def _stop(proc: subprocess.Popen) -> None:
    stop_group(proc)


CONCURRENCY = (1, 4, 8)


def measure_streamed(url: str, model: str, vocab: int, seed: int, reps: int) -> dict:
    """What an API client sees: streamed pp512 (time to first token) and tg128, the same decode on a prompt it
    copies from (bench/grounded.py: where n-gram speculation finds drafts), then 1/4/8 streams at once."""
    rng = random.Random(seed)
    pp = min(stream_completion(url, model, random_prompt(rng, vocab, 512), 1).ttft_s for _ in range(reps))
    tg = max(stream_completion(url, model, random_prompt(rng, vocab, 1), 128).decode_tps for _ in range(reps))
    grounded = grounded_decode_tps(url, model, reps)
    levels = [concurrent_streams(url, model, vocab, n, 32, 64, seed + n) for n in CONCURRENCY]
    return {"pp512_tps": 512 / pp, "tg128_tps": tg, "grounded_tg128_tps": grounded, "concurrency": levels}


@dataclass(frozen=True)
class Launch:
    """How to start one arm's server: its command, environment, model name and compile-cache state."""

    cmd: list[str]
    env: dict[str, str]
    model: str
    cache: str = "cold"  # "cold" or "warm"


def spark_edge_launch(
    tag: str,
    checkpoint: Path,
    home: Path,
    port: int,
    serve_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> Launch:
    arm_home = home / "arms" / tag  # its own data folder, hence its own compile cache
    cache = "warm" if (arm_home / "vllm-cache").exists() else "cold"
    cmd = [
        sys.executable,
        "-m",
        "spark_edge.cli",
        "serve",
        "--model",
        str(checkpoint),
        "--port",
        str(port),
        *serve_args,
    ]
    full_env = {**os.environ, HOME.name: str(arm_home), **(env or {})}
    full_env.pop(API_KEY.name, None)  # the bench talks to its own servers without a key
    return Launch(cmd, full_env, checkpoint.name, cache)


def run_arm(
    tag: str,
    checkpoint: Path,
    vocab: int,
    home: Path,
    log_path: Path,
    reps: int = 3,
    serve_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    ready_timeout_s: float = 900,
    fidelity_windows: list[list[int]] | None = None,
    served: bool = False,
) -> ArmResult:
    """One spark-edge arm: `spark-edge serve` on a built checkpoint."""
    port = free_port()
    launch = spark_edge_launch(tag, checkpoint, home, port, serve_args, env)
    return measure_server(tag, launch, port, vocab, log_path, reps, ready_timeout_s, fidelity_windows, served)


def measure_server(
    tag: str,
    launch: Launch,
    port: int,
    vocab: int,
    log_path: Path,
    reps: int = 3,
    ready_timeout_s: float = 900,
    fidelity_windows: list[list[int]] | None = None,
    served: bool = False,
) -> ArmResult:
    """Start a server speaking the OpenAI API (spark-edge or a peer), measure it the same way, stop it."""
    url = f"http://127.0.0.1:{port}"
    # no log tail in the error: it is the arm's result, and the bench names the log beside it
    with ServerProcess(launch.cmd, f"{url}/health", log_path, launch.env, tail_lines=0) as server:
        sampler = TreeRssSampler(server.pid).start()
        try:
            ready_s = server.wait_ready(ready_timeout_s)
            load_peak = sampler.peak
            time.sleep(3)  # let the allocator settle before reading the idle figure
            settled = sampler.current
            client = _Client(url, launch.model, vocab, seed=zlib.crc32(tag.encode()))
            client.complete(8, 8)  # one warm-up request
            pp = min(client.complete(512, 1) for _ in range(reps))
            t1 = min(client.complete(1, 1) for _ in range(reps))
            t128 = min(client.complete(1, 128) for _ in range(reps))
            scrape = min(_timed_get(f"{url}/metrics") for _ in range(5))
            result = ArmResult(
                tag, ready_s, load_peak, settled, 512 / pp, 127 / (t128 - t1), sampler.peak, launch.cache, scrape
            )
            if served:
                result.served = measure_streamed(url, launch.model, vocab, zlib.crc32(tag.encode()), reps)
            if fidelity_windows:
                scored = score(url, launch.model, fidelity_windows)
                result.perplexity, result.top1 = scored.perplexity, scored.top1
            return result
        finally:
            sampler.stop()
