"""The default model served by a real vLLM engine (one server for the session)."""

from __future__ import annotations

import pytest
import requests

from conftest import Server
from spark_edge.checkpoints.default_model import DEFAULT_MODEL_ID

pytestmark = pytest.mark.engine


def _model_name(server: Server) -> str:
    models = requests.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == [DEFAULT_MODEL_ID]
    return models[0]["id"]


def test_health_is_200_when_ready(bf16_server: Server) -> None:
    assert requests.get(f"{bf16_server.url}/health", timeout=10).status_code == 200


def test_greedy_completion_knows_paris(bf16_server: Server) -> None:
    body = {"model": _model_name(bf16_server), "prompt": "The capital of France is", "max_tokens": 8,
            "temperature": 0}
    reply = requests.post(f"{bf16_server.url}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert "Paris" in choice["text"]
    assert reply.json()["usage"]["completion_tokens"] >= 1


def test_chat_completion_answers(bf16_server: Server) -> None:
    body = {"model": _model_name(bf16_server), "max_tokens": 24, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    reply = requests.post(f"{bf16_server.url}/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    message = reply.json()["choices"][0]["message"]
    assert message["role"] == "assistant"
    assert "Paris" in message["content"]


def test_served_checkpoint_was_not_rebuilt(bf16_server: Server) -> None:
    assert "up to date" in bf16_server.log_path.read_text(errors="replace")


def test_metrics_endpoint_serves_vllm_series(bf16_server: Server) -> None:
    text = requests.get(f"{bf16_server.url}/metrics", timeout=10).text
    assert "vllm:num_requests_running" in text
