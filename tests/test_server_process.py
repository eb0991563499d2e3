"""ServerProcess without an engine: a fake server (a stdlib HTTP server in a child) started, waited for, stopped.

Each test takes a second or two: the fake answers /health 503 for FAKE_DELAY seconds, then 200, and on
SIGTERM exits 0 (as `spark-edge serve` does after draining) or, with FAKE_ON_TERM=ignore, stays until SIGKILL.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import requests

from spark_edge.serving.server_process import ServerExited, ServerProcess, free_port

FAKE = """
import http.server, os, signal, subprocess, sys, time

argv = sys.argv[1:]
port = int(argv[argv.index("--port") + 1])  # any argv: the tests' Server wraps `spark-edge serve` around it
delay = float(os.environ.get("FAKE_DELAY", "0"))
if os.environ.get("FAKE_ON_TERM") == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
child = subprocess.Popen(["sleep", "300"])  # a process of the group, as vLLM's engine core is
if "FAKE_CHILD_PID" in os.environ:
    with open(os.environ["FAKE_CHILD_PID"], "w") as f:
        f.write(str(child.pid))
start = time.monotonic()


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ok = self.path != "/health" or time.monotonic() - start >= delay
        self.send_response(200 if ok else 503)
        self.end_headers()
        self.wfile.write(b"ok" if ok else b"loading")

    def log_message(self, *args):
        pass


server = http.server.HTTPServer(("127.0.0.1", port), Handler)
print(f"fake: listening on {port}", flush=True)
server.serve_forever()
"""


@pytest.fixture
def fake(tmp_path: Path) -> Path:
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE)
    return script


def _fake(fake: Path, tmp_path: Path, delay: float = 0, on_term: str = "exit0", **kw) -> tuple[ServerProcess, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "FAKE_DELAY": str(delay),
        "FAKE_ON_TERM": on_term,
        "FAKE_CHILD_PID": str(tmp_path / "child.pid"),
    }
    server = ServerProcess(
        [sys.executable, str(fake), "--port", str(port)], f"{url}/health", tmp_path / "fake.log", env, poll_s=0.05, **kw
    )
    return server, url


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie is dead, only not yet reaped by whoever adopted it


def _eventually(check: Callable[[], bool], timeout_s: float = 5) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check() and time.monotonic() < deadline:
        time.sleep(0.05)
    return check()


def test_wait_ready_returns_the_seconds_from_launch_to_the_first_200(fake: Path, tmp_path: Path) -> None:
    server, url = _fake(fake, tmp_path, delay=0.5)
    with server:
        ready_s = server.wait_ready(30)
        assert 0.5 <= ready_s < 20
        assert requests.get(f"{url}/health", timeout=5).status_code == 200
    assert server.proc is not None and server.proc.returncode == 0  # stopped on leaving the block


def test_stop_terminates_the_whole_group_and_returns_the_exit_code(fake: Path, tmp_path: Path) -> None:
    server, _ = _fake(fake, tmp_path)
    server.start()
    server.wait_ready(30)
    child = int((tmp_path / "child.pid").read_text())
    assert _alive(child)
    assert server.stop() == 0
    assert _eventually(lambda: not _alive(child)), "the server's child outlived the stop"
    assert server.stop() == 0  # again: no signal, the same code


def test_a_server_that_ignores_sigterm_is_killed_after_the_timeout(fake: Path, tmp_path: Path) -> None:
    server, _ = _fake(fake, tmp_path, on_term="ignore")
    server.start()
    server.wait_ready(30)
    start = time.monotonic()
    assert server.stop(timeout_s=0.5) == -signal.SIGKILL
    assert time.monotonic() - start < 10


def test_stop_after_the_server_exited_on_its_own_signal_keeps_its_code(fake: Path, tmp_path: Path) -> None:
    """As the drain tests do: SIGTERM to the main process only, wait, then the fixture's stop()."""
    server, _ = _fake(fake, tmp_path)
    server.start()
    server.wait_ready(30)
    os.kill(server.pid, signal.SIGTERM)
    assert server.proc is not None and server.proc.wait(10) == 0
    assert server.stop() == 0
    os.kill(int((tmp_path / "child.pid").read_text()), signal.SIGKILL)  # the fake leaves its child: not a drain


def test_a_server_that_exits_fails_the_wait_at_once_with_the_log_tail(tmp_path: Path) -> None:
    cmd = [sys.executable, "-c", "print('spark-edge: error: no such weight path'); raise SystemExit(3)"]
    server = ServerProcess(cmd, f"http://127.0.0.1:{free_port()}/health", tmp_path / "dead.log")
    with server, pytest.raises(ServerExited) as exited:
        start = time.monotonic()
        server.wait_ready(300)
    assert time.monotonic() - start < 30  # not the 300 s deadline
    assert exited.value.returncode == 3
    assert str(exited.value) == "server exited with 3:\nspark-edge: error: no such weight path"


def test_without_tail_lines_the_errors_are_the_bare_messages(fake: Path, tmp_path: Path) -> None:
    """The bench's wording: its arms record the message and name the log beside it."""
    cmd = [sys.executable, "-c", "raise SystemExit(2)"]
    dead = ServerProcess(cmd, f"http://127.0.0.1:{free_port()}/health", tmp_path / "dead.log", tail_lines=0)
    with dead, pytest.raises(ServerExited, match=r"\Aserver exited with 2\Z"):
        dead.wait_ready(300)
    server, _ = _fake(fake, tmp_path, delay=60, tail_lines=0)
    with server, pytest.raises(TimeoutError, match=r"\Aserver not ready after 0.5 s\Z"):
        server.wait_ready(0.5)


def test_a_server_not_ready_by_the_deadline_times_out_with_the_log_tail(fake: Path, tmp_path: Path) -> None:
    server, _ = _fake(fake, tmp_path, delay=60)
    with server, pytest.raises(TimeoutError) as late:
        server.wait_ready(1)
    assert str(late.value).startswith("server not ready after 1 s:\n") and "fake: listening" in str(late.value)


def test_the_log_is_appended_unless_asked_otherwise(tmp_path: Path) -> None:
    log = tmp_path / "arm.log"
    log.write_text("pass 1\n")
    for append in (True, False):
        server = ServerProcess([sys.executable, "-c", "print('pass 2')"], "http://127.0.0.1:1/", log, append=append)
        with server:
            assert server.proc is not None and server.proc.wait(30) == 0
        assert log.read_text() == ("pass 1\npass 2\n" if append else "pass 2\n")


def test_without_a_log_the_output_is_discarded_and_the_tail_is_empty(tmp_path: Path) -> None:
    server = ServerProcess([sys.executable, "-c", "print('lost')"], "http://127.0.0.1:1/")
    assert server.stop() is None  # never started: nothing to stop
    with server:
        assert server.proc is not None and server.proc.wait(30) == 0
    assert server.log_tail() == ""


def test_the_bench_helpers_wait_for_and_stop_a_popen_started_elsewhere(fake: Path) -> None:
    """tests/test_bench_peer.py launches llama-server itself and uses these two."""
    import subprocess

    from spark_edge.bench.server_arm import _stop, _wait_ready

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(fake), "--port", str(port)], stdout=subprocess.DEVNULL, start_new_session=True
    )
    try:
        _wait_ready(proc, f"http://127.0.0.1:{port}", 30)
    finally:
        _stop(proc)
    assert proc.returncode == 0


def test_the_tests_server_fixture_runs_on_server_process(fake: Path, tmp_path: Path) -> None:
    """conftest's Server: its argv wrapped by `wrap`, here the fake (which reads --port from it)."""
    from conftest import Server

    server = Server(
        ["--weight-path", "bf16"],
        tmp_path,
        tmp_path / "server.log",
        wrap=[sys.executable, str(fake)],
        env={"FAKE_DELAY": "0.3"},
        api_key="sk-test",
    )
    try:
        assert server.wait_ready(30) >= 0.3
        assert server.get("/v1/models").status_code == 200
        assert f"fake: listening on {server.port}" in server.log_tail()
        assert server.headers == {"Authorization": "Bearer sk-test"} and server.proc is not None
    finally:
        assert server.stop() == 0
