"""The SIGTERM drain, without an engine: once vLLM's shutdown starts, new requests get 503 (never
vLLM's 500) and /health fails, while /metrics stays readable. The engine-level proof (streams in
flight finish, exit 0) is in test_server_lifecycle.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from fastapi.testclient import TestClient

from spark_edge.runtime import draining, fixes


@pytest.fixture
def fresh_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(draining, "_draining", threading.Event())


def _app() -> TestClient:
    app = FastAPI()
    for path in ("/v1/completions", "/health", "/metrics"):
        app.add_api_route(path, lambda: PlainTextResponse("ok"), methods=["GET", "POST"])
    app.middleware("http")(draining.refuse_while_draining)  # as vLLM installs a --middleware function
    return TestClient(app)


def test_requests_pass_until_the_drain_begins_then_get_503(fresh_flag: None) -> None:
    client = _app()
    assert [client.get(p).status_code for p in ("/v1/completions", "/health", "/metrics")] == [200, 200, 200]
    draining.begin_draining()
    late = client.post("/v1/completions", json={"prompt": "hi"})
    assert late.status_code == 503 and late.headers["retry-after"] == "5"
    assert late.headers["connection"] == "close"
    assert "shutting down" in late.json()["error"]["message"]
    assert client.get("/health").status_code == 503  # a readiness probe stops routing here
    assert client.get("/metrics").status_code == 200  # scrapers still see the drain


def test_the_drain_is_flagged_before_vllms_shutdown_runs(fresh_flag: None) -> None:
    seen: list[bool] = []

    class Engine:
        def shutdown(self, timeout: float | None = None) -> str:
            seen.append(draining.is_draining())
            return f"stopped within {timeout}"

    Engine.shutdown = fixes.mark_drain_start(Engine.shutdown)
    assert fixes.mark_drain_start(Engine.shutdown) is Engine.shutdown  # wraps once
    assert not draining.is_draining()
    assert Engine().shutdown(timeout=20) == "stopped within 20"
    assert seen == [True]


def test_vllms_async_llm_shutdown_is_wrapped_when_imported() -> None:
    check = textwrap.dedent("""
        import sys
        from spark_edge.runtime import fixes
        fixes.apply_runtime_fixes()
        assert "vllm.v1.engine.async_llm" not in sys.modules
        from vllm.v1.engine.async_llm import AsyncLLM
        assert getattr(AsyncLLM.shutdown, fixes._MARK) == "drain_start"
        print("WRAPPED")
    """)
    run = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "WRAPPED" in run.stdout, run.stderr[-3000:]
