"""What an edge box meets: a 200 MB body, clients that drop streams by the hundred, and the OOM killer picking
the engine process. One server of its own (no API key, the shared servers have one), killed at the end."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import requests

from spark_edge import exit_codes
from spark_edge.checkpoints.default_model import DEFAULT_MODEL_ID
from spark_edge.metrics.process_tree import process_tree, tree_rss_anon_bytes
from spark_edge.serving.request_limits import DEFAULT_MAX_REQUEST_BYTES

from conftest import Server

pytestmark = pytest.mark.engine

MiB = 2**20
GOOD = {"model": DEFAULT_MODEL_ID, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def fault_server(
    bf16_server: Server, spark_edge_home: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """bf16 without an API key; started after bf16_server so its compile cache is warm. In the engine layout: the
    OOM killer's pick below is an engine process (in the single layout it would kill the server itself)."""
    args = ["--weight-path", "bf16", "--process-layout", "engine"]
    server = Server(args, spark_edge_home, tmp_path_factory.mktemp("logs") / "faults.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def _rss(server: Server) -> int:
    return tree_rss_anon_bytes(process_tree(server.proc.pid))


def _raw_post(server: Server, headers: dict[str, str], chunks: Iterator[bytes], key: str | None = None) -> bytes:
    """Send a POST by hand (requests cannot stop sending a body when the server answers early)."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    head = {"Host": "127.0.0.1", "Content-Type": "application/json", **headers}
    if key:
        head["Authorization"] = f"Bearer {key}"
    sock.sendall(
        ("POST /v1/completions HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in head.items()) + "\r\n").encode()
    )
    try:
        for chunk in chunks:
            sock.sendall(chunk)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server answered and closed: what it did not read, it never buffered
    reply = b""
    try:
        while data := sock.recv(65536):
            reply += data
    except ConnectionResetError:
        pass
    sock.close()
    return reply


def _body_of(total: int, piece: int = MiB) -> Iterator[bytes]:
    sent = 0
    while sent < total:
        n = min(piece, total - sent)
        yield b" " * n
        sent += n


def test_a_200_mb_body_gets_413_without_being_read(fault_server: Server) -> None:
    before = _rss(fault_server)
    size = 200 * 10**6
    reply = _raw_post(fault_server, {"Content-Length": str(size)}, _body_of(size))
    assert reply.startswith(b"HTTP/1.1 413"), reply[:300]
    assert b"larger than this server accepts" in reply
    time.sleep(2)  # the gauge-free way: the tree's anonymous RSS, measured again
    grown = _rss(fault_server) - before
    print(f"413 for a 200 MB body; tree anonymous RSS grew by {grown / MiB:.1f} MiB")
    assert grown < 20 * MiB


def test_a_chunked_body_is_stopped_at_the_limit(fault_server: Server) -> None:
    def chunked() -> Iterator[bytes]:
        for piece in _body_of(DEFAULT_MAX_REQUEST_BYTES * 4, 256 * 1024):
            yield f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
        yield b"0\r\n\r\n"

    reply = _raw_post(fault_server, {"Transfer-Encoding": "chunked"}, chunked())
    assert reply.startswith(b"HTTP/1.1 413"), reply[:300]
    assert requests.post(f"{fault_server.url}/v1/completions", json=GOOD, timeout=120).status_code == 200


def test_the_limit_holds_behind_an_api_key(bf16_server: Server) -> None:
    size = 64 * MiB
    reply = _raw_post(bf16_server, {"Content-Length": str(size)}, _body_of(size), key=bf16_server.api_key)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:300]
    assert bf16_server.post("/v1/completions", GOOD).status_code == 200


def _gauge(metrics: str, name: str) -> float:
    values = [float(v) for v in re.findall(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", metrics, re.M)]
    assert values, f"{name} not in /metrics"
    return sum(values)


async def _dropping_clients(url: str, requests_total: int, clients: int) -> int:
    """`clients` at a time, each stream read for 1-5 tokens and then dropped; returns the streams dropped."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests_total):
        queue.put_nowait(i)
    dropped = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal dropped
        while not queue.empty():
            i = queue.get_nowait()
            body = {
                **GOOD,
                "prompt": f"Request {i}: tell me a long story about",
                "max_tokens": 64,
                "stream": True,
                "ignore_eos": True,
            }
            async with http.stream("POST", f"{url}/v1/completions", json=body) as reply:
                assert reply.status_code == 200
                wanted, seen = 1 + i % 5, 0
                async for line in reply.aiter_lines():
                    seen += line.startswith("data: {")
                    if seen >= wanted:
                        break  # leaving the block closes the connection mid-stream
            dropped += 1

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=clients)) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return dropped


def test_hundreds_of_dropped_streams_leave_nothing_behind(fault_server: Server) -> None:
    assert requests.post(f"{fault_server.url}/v1/completions", json=GOOD, timeout=120).status_code == 200
    before = _rss(fault_server)
    started = time.monotonic()
    assert asyncio.run(_dropping_clients(fault_server.url, 500, 50)) == 500
    took = time.monotonic() - started
    deadline = time.monotonic() + 30
    while True:  # the engine learns of each drop at its next step
        metrics = requests.get(f"{fault_server.url}/metrics", timeout=10).text
        running = _gauge(metrics, "vllm:num_requests_running")
        waiting = _gauge(metrics, "vllm:num_requests_waiting")
        if running == waiting == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert (running, waiting) == (0, 0)
    reply = requests.post(f"{fault_server.url}/v1/completions", json=GOOD, timeout=120)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
    after = _rss(fault_server)
    print(
        f"500 streams dropped after 1-5 tokens by 50 clients in {took:.1f} s; running/waiting back to 0; "
        f"tree anonymous RSS {before / MiB:.0f} -> {after / MiB:.0f} MiB ({(after - before) / before:+.1%})"
    )
    assert abs(after - before) <= 0.05 * before


def _engine_pid(server: Server) -> int:
    for pid in process_tree(server.proc.pid):
        if b"EngineCore" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise AssertionError("no EngineCore process under the server")


def test_sigkill_of_the_engine_fails_health_and_exits_non_zero(fault_server: Server) -> None:
    """Last in this file: it ends the server. The OOM killer sends SIGKILL to the largest process: the engine."""
    engine = _engine_pid(fault_server)
    killed = time.monotonic()
    os.kill(engine, signal.SIGKILL)
    unhealthy_after = None
    while fault_server.proc.poll() is None and time.monotonic() - killed < 60:
        try:
            code = requests.get(f"{fault_server.url}/health", timeout=1).status_code
        except requests.ConnectionError:
            code = None
        if code != 200 and unhealthy_after is None:
            unhealthy_after = time.monotonic() - killed
        time.sleep(0.1)
    try:
        exit_code = fault_server.proc.wait(timeout=1)
    except Exception:
        exit_code = None
    exited_after = time.monotonic() - killed
    print(
        f"engine SIGKILLed: /health non-200 after {unhealthy_after:.2f} s, server exited {exit_code} after "
        f"{exited_after:.1f} s"
    )
    assert unhealthy_after is not None and unhealthy_after < 2
    assert exit_code == exit_codes.ENGINE_DIED, fault_server.log_tail()
    assert exited_after < 10
    assert "the engine process was killed by SIGKILL" in fault_server.log_tail()
