"""The served process layout, through real servers.

The session's w4a16 server runs what `spark-edge serve` runs by default: vLLM's model worker
inside the engine-core process. Servers started here run vLLM's own layout (the worker in a
process of its own, which vLLM binds to one core) and ours on one thread, so the greedy
token ids of the two layouts can be compared at equal thread counts.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from spark_edge.checkpoints.default_model import DEFAULT_MODEL_ID
from spark_edge.metrics.process_tree import process_tree

from conftest import Server, running_server

pytestmark = pytest.mark.engine

PROMPTS = [
    "The capital of France is",
    "List three colours of the rainbow:",
    # long enough that prefill is a many-row GEMM
    "Once upon a time, in a small village by the sea, there lived an old fisherman who " * 6,
]


def _cmdlines(pids: list[int]) -> list[str]:
    lines = []
    for pid in pids:
        try:
            lines.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip())
        except OSError:
            pass
    return lines


def _vllm_processes(server: Server) -> list[int]:
    """The server's Python processes, without helpers that compute nothing (multiprocessing's
    resource tracker) and non-Python children (compilers)."""
    pids = []
    for pid in process_tree(server.proc.pid):
        try:
            exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
        except OSError:
            continue
        if "python" in exe and "resource_tracker" not in "".join(_cmdlines([pid])):
            pids.append(pid)
    return pids


def _greedy_token_ids(server: Server) -> list[list[int]]:
    """Greedy completions of every prompt, as token ids, one request at a time.

    One at a time because the step a prompt lands in depends on timing (the prompts of one
    multi-prompt request reach the engine as separate requests): a 6-token prompt prefilled alone
    runs the int4 kernel row by row, the same prompt batched with a 120-token one runs the
    dequantized GEMM, and the two round differently (CI saw tokens part after 11 steps).
    Every kernel path is still crossed: short prefill, long prefill, single-row decode."""
    ids = []
    for prompt in PROMPTS:
        body = {
            "model": DEFAULT_MODEL_ID,
            "prompt": prompt,
            "max_tokens": 24,
            "temperature": 0,
            "return_token_ids": True,
        }
        reply = server.post("/v1/completions", body)
        assert reply.status_code == 200, reply.text
        (choice,) = reply.json()["choices"]
        assert choice.get("token_ids"), f"the server returned no token ids: {choice}"
        ids.append(choice["token_ids"])
    return ids


@pytest.fixture(scope="module")
def split_server(
    spark_edge_home: Path, w4a16_server: Server, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """vLLM's own CPU layout: the worker in a process of its own, bound by vLLM to one core."""
    yield from running_server(
        "w4a16_split", ["--weight-path", "w4a16", "--process-layout", "split"], spark_edge_home, tmp_path_factory
    )


@pytest.fixture(scope="module")
def engine_one_thread_server(
    spark_edge_home: Path, split_server: Server, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """Our layout computing on one thread, as the split layout's worker does: the layouts compared alone."""
    yield from running_server(
        "w4a16_engine_1thread",
        ["--weight-path", "w4a16", "--process-layout", "engine"],
        spark_edge_home,
        tmp_path_factory,
        env={"OMP_NUM_THREADS": "1"},
    )


def test_default_layout_runs_the_worker_inside_the_engine_core(w4a16_server: Server) -> None:
    pids = _vllm_processes(w4a16_server)
    assert len(pids) == 2, "expected the API server and the engine core only:\n" + "\n".join(_cmdlines(pids))


def test_split_layout_has_a_worker_process_of_its_own(split_server: Server) -> None:
    assert len(_vllm_processes(split_server)) == 3


def test_greedy_tokens_identical_across_layouts(engine_one_thread_server: Server, split_server: Server) -> None:
    """Same code, same thread count, the worker in another process: the very same tokens. (The C
    dequantization's bit-identity with the torch path is tested at the op, tests/test_cpu_int4.py.)"""
    assert _greedy_token_ids(engine_one_thread_server) == _greedy_token_ids(split_server)


def _stream(server: Server, i: int) -> int:
    body = {
        "model": DEFAULT_MODEL_ID,
        "prompt": f"Request {i}: write a sentence about the sea.",
        "max_tokens": 32,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    chunks = 0
    with requests.post(
        f"{server.url}/v1/completions", json=body, headers=server.headers, stream=True, timeout=300
    ) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                chunks += sum(len(c["text"]) > 0 for c in json.loads(line[6:])["choices"])
    return chunks


def test_eight_concurrent_streams_all_complete(w4a16_server: Server) -> None:
    with ThreadPoolExecutor(8) as pool:
        streamed = list(pool.map(lambda i: _stream(w4a16_server, i), range(8)))
    assert all(n > 0 for n in streamed), streamed
    assert w4a16_server.get("/health").status_code == 200


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"  # a zombie has exited; only its parent's wait is missing


def test_sigterm_shutdown_leaves_no_orphan_process(split_server: Server) -> None:
    """Last in this module: SIGTERM to the server process alone (as a supervisor sends it), not its group."""
    tree = process_tree(split_server.proc.pid)
    assert len(tree) >= 3
    split_server.proc.send_signal(signal.SIGTERM)
    assert split_server.proc.wait(60) == 0, split_server.log_tail()
    deadline = time.monotonic() + 30
    while (alive := [pid for pid in tree if _running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive, f"left behind: {_cmdlines(alive)}"
