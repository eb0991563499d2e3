"""A server in a child process: launch it, wait until it answers, stop it.

The one body behind the bench's arms, `bench --load` and the tests' server fixtures. The child
leads a session of its own, so stopping it reaches the whole tree (vLLM's engine core and workers)
and a Ctrl-C meant for the caller does not reach it first.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Self

import requests

READY_PROBE_TIMEOUT_S = 2  # one GET of the ready URL: a loading server may be slow to answer


def free_port() -> int:
    """A loopback port free at this moment (the server binds it a little later: good enough on one host)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerExited(RuntimeError):
    """The server process ended before it answered."""

    def __init__(self, message: str, returncode: int):
        super().__init__(message)
        self.returncode = returncode


def _answers(url: str, verify: str | bool) -> bool:
    try:
        return requests.get(url, timeout=READY_PROBE_TIMEOUT_S, verify=verify).status_code == 200
    except (requests.ConnectionError, requests.Timeout):  # not listening yet, or busy loading
        return False


def _with_tail(message: str, tail: Callable[[], str] | None) -> str:
    return f"{message}:\n{tail()}" if tail else message


def wait_until_answers(
    proc: subprocess.Popen,
    url: str,
    timeout_s: float,
    poll_s: float = 0.25,
    verify: str | bool = True,
    tail: Callable[[], str] | None = None,
) -> None:
    """Poll `url` until it answers 200; raise ServerExited as soon as `proc` ends, TimeoutError at the
    deadline (both with `tail()`, the log's end, when given)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerExited(_with_tail(f"server exited with {proc.returncode}", tail), proc.returncode)
        if _answers(url, verify):
            return
        time.sleep(poll_s)
    raise TimeoutError(_with_tail(f"server not ready after {timeout_s} s", tail))


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:  # the whole group is gone already
        pass


def stop_group(proc: subprocess.Popen, timeout_s: float = 60) -> int:
    """SIGTERM to the process group `proc` leads (it was started in a new session), up to `timeout_s` for it
    to exit (vLLM drains in-flight requests first), then SIGKILL. Returns its exit code; a no-op if it has
    exited already, so a test that signalled it itself still reads the code it exited with."""
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


class ServerProcess:
    """`cmd` in a new session with stdout and stderr to `log_path` (None: discarded), ready once `ready_url`
    answers 200. As a context manager: started on entry, stopped on exit.

    `tail_lines`: how much of the log's end the errors of wait_ready carry (0: none, the caller names the log).
    """

    def __init__(
        self,
        cmd: list[str],
        ready_url: str,
        log_path: Path | None = None,
        env: dict[str, str] | None = None,
        *,
        append: bool = True,
        poll_s: float = 0.25,
        verify: str | bool = True,
        tail_lines: int = 60,
    ):
        self.cmd, self.ready_url, self.log_path, self.env = cmd, ready_url, log_path, env
        self.append, self.poll_s, self.verify, self.tail_lines = append, poll_s, verify, tail_lines
        self.proc: subprocess.Popen | None = None
        self.started = 0.0  # time.monotonic() just before the launch
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def start(self) -> Self:
        if self.log_path is not None:
            self._log = open(self.log_path, "ab" if self.append else "wb")  # noqa: SIM115 (closed by stop)
        out = self._log if self._log is not None else subprocess.DEVNULL
        self.started = time.monotonic()
        try:
            self.proc = subprocess.Popen(
                self.cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        except BaseException:
            self._close_log()
            raise
        return self

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds from the launch to the first 200 from `ready_url` (the time to ready)."""
        assert self.proc is not None, "not started"
        tail = (lambda: self.log_tail(self.tail_lines)) if self.tail_lines else None
        wait_until_answers(self.proc, self.ready_url, timeout_s, self.poll_s, self.verify, tail)
        return time.monotonic() - self.started

    def log_tail(self, n: int = 60) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self, timeout_s: float = 60) -> int | None:
        """Stop the group (see stop_group) and close the log; the exit code, None if never started.
        Safe to call again."""
        returncode = stop_group(self.proc, timeout_s) if self.proc is not None else None
        self._close_log()
        return returncode

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
