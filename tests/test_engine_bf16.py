"""The default model served by a real vLLM engine (one server for the session)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import requests

from spark_edge.checkpoints.default_model import DEFAULT_MODEL_ID
from spark_edge.planning.memory_plan import make_plan
from spark_edge.planning.model_shape import ModelShape
from spark_edge.probe.cpu_features import host_has_bf16_gemm
from spark_edge.probe.device import probe_device
from spark_edge.probe.isa import has_avx512
from spark_edge.serving.process_layout import DEFAULT_LAYOUT

from conftest import Server

pytestmark = pytest.mark.engine


def _model_name(server: Server) -> str:
    models = server.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == [DEFAULT_MODEL_ID]
    return models[0]["id"]


def test_health_is_200_when_ready(bf16_server: Server) -> None:
    assert requests.get(f"{bf16_server.url}/health", timeout=10).status_code == 200


def test_completion_knows_paris(bf16_server: Server) -> None:
    bf16_server.assert_knows_paris(_model_name(bf16_server))


def test_greedy_completion_protocol(bf16_server: Server) -> None:
    body = {
        "model": _model_name(bf16_server),
        "prompt": "The capital of France is",
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    reply = bf16_server.post("/v1/completions", body)
    assert reply.status_code == 200, reply.text
    choice, usage = reply.json()["choices"][0], reply.json()["usage"]
    assert choice["text"] and choice["finish_reason"] == "length"
    assert usage["completion_tokens"] == 8 and usage["prompt_tokens"] >= 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_chat_completion_answers(bf16_server: Server) -> None:
    """The chat protocol (what the answer says depends on the host's rounding: see conftest)."""
    body = {
        "model": _model_name(bf16_server),
        "max_tokens": 24,
        "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
    }
    reply = bf16_server.post("/v1/chat/completions", body)
    assert reply.status_code == 200, reply.text
    choice, usage = reply.json()["choices"][0], reply.json()["usage"]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"].strip()
    assert choice["finish_reason"] in ("stop", "length")
    assert 1 <= usage["completion_tokens"] <= 24
    assert usage["prompt_tokens"] > len("What is the capital of France?".split())  # the chat template's tokens too
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_served_checkpoint_was_not_rebuilt(bf16_server: Server) -> None:
    assert "up to date" in bf16_server.log_path.read_text(errors="replace")


def _scrape(server: Server) -> dict[str, float]:
    """`name{labels}` -> value for every sample on /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{server.url}/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


@pytest.mark.parametrize("path", ["bf16", "w4a16"])
def test_metrics_keep_vllm_series_and_add_ours(path: str, request: pytest.FixtureRequest) -> None:
    server: Server = request.getfixturevalue(f"{path}_server")
    # a completion and a chat request first, so the decode rate has something to show
    body = {
        "model": _model_name(server),
        "prompt": "Once upon a time",
        "max_tokens": 32,
        "temperature": 0,
        "ignore_eos": True,
    }
    assert server.post("/v1/completions", body).status_code == 200
    chat = {"model": _model_name(server), "max_tokens": 8, "messages": [{"role": "user", "content": "Hello"}]}
    assert server.post("/v1/chat/completions", chat).status_code == 200
    m = _scrape(server)
    assert any(k.startswith("vllm:num_requests_running") for k in m)
    assert any(k.startswith("vllm:generation_tokens_total") for k in m)
    # the decode rate is PromQL's, from vLLM's inter-token latency histogram: its count (decode steps) and sum
    decode_steps = sum(v for k, v in m.items() if k.startswith("vllm:inter_token_latency_seconds_count"))
    decode_seconds = sum(v for k, v in m.items() if k.startswith("vllm:inter_token_latency_seconds_sum"))
    assert decode_steps >= 31 and decode_seconds > 0  # at least the completion's 32 tokens after its first
    current, peak = m["spark_edge_process_rss_anon_bytes"], m["spark_edge_process_rss_anon_peak_bytes"]
    assert peak >= current > 100 * 2**20
    assert m["spark_edge_load_rss_anon_peak_bytes"] > 100 * 2**20
    assert m["spark_edge_memory_limit_bytes"] > peak
    phases = {p: m[f"spark_edge_startup_seconds{{phase={p}}}"] for p in ("imports", "probe", "checkpoint")}
    phases |= {p: m[f"spark_edge_startup_seconds{{phase={p}}}"] for p in ("vllm_imports", "engine", "ready")}
    assert all(seconds > 0 for seconds in phases.values()), phases
    # ready is serve's clock to the engine ready: every phase after the imports lies within it
    assert phases["ready"] >= phases["probe"] + phases["checkpoint"] + phases["vllm_imports"] + phases["engine"]
    info = [k for k in m if k.startswith("spark_edge_build_info")]
    assert len(info) == 1 and f"weight_path={path}" in info[0] and "vllm_version=0.32.0" in info[0]
    # each weight path has its own cache folder, empty at the session's first start of it: compiled
    assert m["spark_edge_compile_cache_misses_total{reason=no_artifact}"] >= 1
    assert m["spark_edge_compile_cache_hits_total"] == 0


# Where the plan's bf16 weight terms were measured: CPUs with bf16 GEMM hardware (the table copies), and AVX-512
# without it (Skylake-SP: oneDNN's converted copies, BF16_FACTOR_WITHOUT_BF16_HARDWARE). On an AVX2-only CPU (an
# AMD EPYC Zen 3) the plan's load peak without the compiler was 1520 MiB against 1020 measured: still an upper
# bound, as asserted everywhere, but that class's bf16 terms are not calibrated yet.
BF16_TERMS_MEASURED = host_has_bf16_gemm() or has_avx512(probe_device(Path("/")))


def test_plan_predicts_the_measured_load_peak(bf16_server: Server, bf16_checkpoint: Path) -> None:
    """The load peak of the plan the server ran with bounds the peak sampled through the real start (a
    compiling one: the session's first of this path), and, on the CPU classes its bf16 terms were measured on,
    the plan's load peak without the compiler is within 15% of it."""
    config = json.loads((bf16_checkpoint / "config.json").read_text())
    m = _scrape(bf16_server)
    limit = int(m["spark_edge_memory_limit_bytes"])
    plan = make_plan(ModelShape.from_config(config), "bf16", limit, 2048, 4, layout=DEFAULT_LAYOUT)
    measured = m["spark_edge_load_rss_anon_peak_bytes"]
    print(f"plan load peak {plan.load_peak_bytes / 2**20:.0f} MiB, measured {measured / 2**20:.0f} MiB")
    assert measured <= m["spark_edge_plan_load_peak_bytes"]
    if BF16_TERMS_MEASURED:
        assert abs(plan.load_peak_bytes - measured) / measured <= 0.15


def test_api_key_guards_generation_but_not_probes(bf16_server: Server) -> None:
    body = {"model": DEFAULT_MODEL_ID, "prompt": "Hi", "max_tokens": 1}
    assert requests.post(f"{bf16_server.url}/v1/completions", json=body, timeout=30).status_code == 401
    wrong = {"Authorization": "Bearer not-the-key"}
    assert requests.post(f"{bf16_server.url}/v1/completions", json=body, headers=wrong, timeout=30).status_code == 401
    assert requests.get(f"{bf16_server.url}/v1/models", timeout=30).status_code == 401
    assert requests.get(f"{bf16_server.url}/health", timeout=30).status_code == 200
    assert requests.get(f"{bf16_server.url}/metrics", timeout=30).status_code == 200
    assert bf16_server.post("/v1/completions", body).status_code == 200


def test_the_start_log_carries_no_warning_of_ours(bf16_server: Server) -> None:
    assert "Found duplicate keys" not in bf16_server.log_path.read_text(errors="replace")  # the two middlewares


def test_api_key_never_appears_in_the_logs(bf16_server: Server) -> None:
    assert "API key required" in bf16_server.log_path.read_text(errors="replace")
    assert bf16_server.api_key not in bf16_server.log_path.read_text(errors="replace")


IDLE_WINDOW_S = 20


def _tree_cpu_seconds(server: Server) -> float:
    return _scrape(server)["spark_edge_process_cpu_seconds_total"]


def test_an_idle_server_sleeps(w4a16_server: Server) -> None:
    """The process tree's CPU counter: while it decodes the tree uses about its cores; once requests stop, next
    to nothing (no busy-polling loop, no OpenMP spin). A ratio over a short window each, never a time limit."""
    body = {"model": _model_name(w4a16_server), "prompt": "Once", "max_tokens": 256, "ignore_eos": True}
    start, t0 = _tree_cpu_seconds(w4a16_server), time.monotonic()
    assert w4a16_server.post("/v1/completions", body).status_code == 200
    busy = (_tree_cpu_seconds(w4a16_server) - start) / (time.monotonic() - t0)
    time.sleep(5)  # what follows a request (stat logging, allocator trims) settles
    start, t0 = _tree_cpu_seconds(w4a16_server), time.monotonic()
    time.sleep(IDLE_WINDOW_S)
    idle = (_tree_cpu_seconds(w4a16_server) - start) / (time.monotonic() - t0)
    print(f"\nprocess tree: {busy:.2f} cores decoding, {100 * idle:.2f}% of a core idle over {IDLE_WINDOW_S} s")
    assert busy > 0.5 and idle < busy / 20, (busy, idle)
