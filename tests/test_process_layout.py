"""The served process layouts, through real servers.

The session's w4a16 server runs what `spark-edge serve` runs by default. Servers started here run the
other layouts: vLLM's own (the worker in a process of its own, which vLLM binds to one core), "engine"
(the worker inside the engine-core process) and "single" (the engine core on a thread of the server's
process), so that greedy token ids can be compared at equal thread counts and footprints side by side.
A single-layout engine that raises or hangs ends its server with exit 7 (faults injected by
tests/engine_faults/sitecustomize.py).
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
from spark_edge.metrics.process_tree import process_tree, tree_rss_anon_bytes
from spark_edge.serving.process_layout import DEFAULT_LAYOUT

from conftest import SESSION_API_KEY, Server, running_server

pytestmark = pytest.mark.engine

STUCK_STEP_S = 10  # the fault test's --stuck-step-timeout (the default is for real steps)

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


def _layout_server(layout: str, w4a16_server: Server, home: Path, factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The session's w4a16 server if it runs `layout` (the default), else one of that layout."""
    if layout == DEFAULT_LAYOUT:
        yield w4a16_server
        return
    yield from running_server(f"w4a16_{layout}", ["--weight-path", "w4a16", "--process-layout", layout], home, factory)


@pytest.fixture(scope="module")
def engine_server(spark_edge_home: Path, w4a16_server: Server, tmp_path_factory: pytest.TempPathFactory):
    yield from _layout_server("engine", w4a16_server, spark_edge_home, tmp_path_factory)


@pytest.fixture(scope="module")
def single_server(spark_edge_home: Path, w4a16_server: Server, tmp_path_factory: pytest.TempPathFactory):
    yield from _layout_server("single", w4a16_server, spark_edge_home, tmp_path_factory)


def test_engine_layout_runs_the_worker_inside_the_engine_core(engine_server: Server) -> None:
    pids = _vllm_processes(engine_server)
    assert len(pids) == 2, "expected the API server and the engine core only:\n" + "\n".join(_cmdlines(pids))


def test_single_layout_is_one_process(single_server: Server) -> None:
    pids = _vllm_processes(single_server)
    assert pids == [single_server.proc.pid], "expected the server process alone:\n" + "\n".join(_cmdlines(pids))
    threads = [t.read_text().strip() for t in Path(f"/proc/{single_server.proc.pid}/task").glob("*/comm")]
    assert "EngineCore" in threads, threads


def test_single_and_engine_layouts_decode_the_same_tokens(single_server: Server, engine_server: Server) -> None:
    """The same engine code and thread count, in a thread instead of a process: the very same tokens."""
    assert _greedy_token_ids(single_server) == _greedy_token_ids(engine_server)


def test_single_layout_holds_less_than_the_two_process_one(single_server: Server, engine_server: Server) -> None:
    """#34's footprint, as a ratio measured here: the whole tree's anonymous RSS after the same requests."""
    for server in (single_server, engine_server):
        _greedy_token_ids(server)
    single, engine = (tree_rss_anon_bytes(process_tree(s.proc.pid)) for s in (single_server, engine_server))
    print(f"settled anonymous RSS: single {single / 2**20:.0f} MiB, engine {engine / 2**20:.0f} MiB")
    assert single <= 0.8 * engine


def test_single_layout_streams_eight_at_once(single_server: Server) -> None:
    with ThreadPoolExecutor(8) as pool:
        streamed = list(pool.map(lambda i: _stream(single_server, i), range(8)))
    assert all(n > 0 for n in streamed), streamed
    assert single_server.get("/health").status_code == 200


@pytest.mark.parametrize("fault", ["raise", "hang"])
def test_a_single_layout_engine_that_fails_ends_the_server_with_exit_7(
    fault: str, spark_edge_home: Path, w4a16_server: Server, tmp_path: Path
) -> None:
    """The engine is a thread now: an exception in a step, or a step that never returns, ends the server as an
    engine process's death does (503, then exit 7 naming the cause), within vLLM's 5 s watchdog of being seen."""
    flag = tmp_path / "fault"
    env = {
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent / "engine_faults"), os.environ.get("PYTHONPATH", "")]),
        "SPARK_EDGE_TEST_ENGINE_FAULT": str(flag),
    }
    args = ["--weight-path", "w4a16", "--process-layout", "single", "--stuck-step-timeout", str(STUCK_STEP_S)]
    server = Server(args, spark_edge_home, tmp_path / "server.log", env=env, api_key=SESSION_API_KEY)
    try:
        server.wait_ready()
        flag.write_text(fault)
        body = {"model": DEFAULT_MODEL_ID, "prompt": "Hello", "max_tokens": 4}
        failed_at = time.monotonic()
        try:
            reply = server.post("/v1/completions", body, timeout=STUCK_STEP_S + 15)
            assert reply.status_code >= 500, reply.text  # the request in flight fails ...
        except requests.ConnectionError:
            pass  # ... or its connection closes with the server
        detect = STUCK_STEP_S if fault == "hang" else 0
        code = server.proc.wait(detect + 10 + 5)
        elapsed = time.monotonic() - failed_at
        assert code == 7, server.log_tail()
        log = server.log_path.read_text(errors="replace")
        why = "injected engine fault" if fault == "raise" else "stuck in one step"
        (error,) = [line for line in log.splitlines() if line.startswith("spark-edge: error:")]
        assert why in error, error
        print(f"{fault}: exit 7 {elapsed:.1f} s after the faulty request")
    finally:
        server.stop()


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
