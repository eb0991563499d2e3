"""`spark-edge bench --peer llama.cpp`: the build's choices, parsing recorded peer output, ratios, failures.

The test marked `peer` builds llama.cpp for this host (once per data folder: 12-22 minutes on 2 cores, so it
is left out of the default run like `images_arm`: `make test PYTEST_ARGS="-m peer"`), converts the default
model with llama.cpp's own converter and asks llama-server what follows "The capital of France is".
"""

from __future__ import annotations

import http.server
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from spark_edge import exit_codes
from spark_edge.bench import command as bench_command
from spark_edge.bench import peer_build
from spark_edge.bench.peer_arms import Peer, llama_server_launch, parse_llama_bench, peer_perplexity
from spark_edge.bench.runner import Arm, format_table, summarize
from spark_edge.bench.server_arm import ArmResult
from spark_edge.bench.streams import stream_completion
from spark_edge.cli import main

DATA = Path(__file__).parent / "data"
MiB = 1 << 20


def test_llama_bench_jsonl_recorded_from_b11434_gives_pp512_and_tg128() -> None:
    figures = parse_llama_bench((DATA / "llama-bench-b11434.jsonl").read_text())
    assert figures["pp512_tps"] == pytest.approx(74.920005)
    assert figures["tg128_tps"] > 0 and figures["tg128_stddev_tps"] >= 0
    assert figures["build"] == "b11434 (11434)" and figures["threads"] == 2


def test_llama_bench_output_without_both_tests_is_an_error() -> None:
    first = (DATA / "llama-bench-b11434.jsonl").read_text().splitlines()[0]
    with pytest.raises(ValueError, match="no pp512 and tg128"):
        parse_llama_bench(first)


@pytest.fixture
def replay_server() -> Iterator[str]:
    """Serves the llama-server b11434 stream recorded for a 4-token completion, as it came."""
    body = (DATA / "llama-server-b11434-stream.txt").read_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_the_bench_client_reads_llama_servers_stream(replay_server: str) -> None:
    result = stream_completion(replay_server, "smol", [504, 3458, 282], 4)
    assert result.tokens == 4  # from the usage of the last event
    assert 0 < result.ttft_s <= result.total_s


def test_llama_server_gets_the_threads_slots_and_context_spark_edge_gets(tmp_path: Path) -> None:
    gguf = tmp_path / "m.Q4_K_M.gguf"
    peer = Peer(tmp_path, {"Q4_K_M": gguf, "BF16": tmp_path / "m.BF16.gguf"}, threads=2, context=2048, slots=4)
    launch = llama_server_launch(peer, 8123, {})
    cmd = launch.cmd
    assert cmd[0] == str(tmp_path / "llama-server") and cmd[cmd.index("-m") + 1] == str(gguf)
    assert cmd[cmd.index("-t") + 1] == "2" and cmd[cmd.index("-np") + 1] == "4"
    assert cmd[cmd.index("-c") + 1] == "8192"  # llama-server divides -c among its slots
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and "--metrics" in cmd


def test_an_arm_that_speculates_brings_llama_servers_lookup_decoding_beside_it(tmp_path: Path) -> None:
    peer = Peer(tmp_path, {"Q4_K_M": tmp_path / "m.Q4_K_M.gguf"}, threads=2, context=2048, slots=4)
    plain = Arm(tmp_path, 100, peer=peer)
    lookup = bench_command._peer_lookup_arm(plain)
    assert lookup.peer is not None and not lookup.peer.llama_bench and plain.peer.llama_bench  # llama-bench once
    env = llama_server_launch(lookup.peer, 8123, lookup.env).env
    assert env["LLAMA_ARG_SPEC_TYPE"] == "ngram-simple" and env["PATH"] == os.environ["PATH"]  # over the bench's own
    assert bench_command.parse_arm("w4a16+ngram")[2] == {"SPARK_EDGE_SPECULATION": "ngram"}


def test_native_build_except_on_amx_hosts_where_ggml_amx_is_left_out() -> None:
    plain = peer_build.cmake_args(frozenset({"avx2", "fma", "f16c", "avx512f"}), "x86_64")
    assert "-DGGML_NATIVE=ON" in plain
    amx = peer_build.cmake_args(
        frozenset({"avx2", "fma", "f16c", "avx512f", "avx512_vnni", "amx_tile", "amx_int8"}), "x86_64"
    )
    assert "-DGGML_NATIVE=OFF" in amx and "-DGGML_AVX512=ON" in amx and "-DGGML_AVX512_VNNI=ON" in amx
    assert "-DGGML_AVX512_BF16=OFF" in amx  # named from the host's flags, not assumed
    assert not any("AMX" in arg for arg in amx)
    assert peer_build.build_stamp(frozenset({"avx2"}), plain) != peer_build.build_stamp(frozenset({"avx512f"}), plain)


def test_a_host_without_cmake_gets_one_line_naming_what_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SPARK_EDGE_HOME", str(tmp_path))
    monkeypatch.setattr(peer_build.shutil, "which", lambda tool: None if tool == "cmake" else "/usr/bin/" + tool)
    with pytest.raises(peer_build.PeerUnavailable) as failure:
        peer_build.ensure_built(frozenset({"avx2"}), "x86_64", log=lambda _: None)
    assert "cmake not found" in str(failure.value) and "\n" not in str(failure.value)


def test_an_unknown_peer_is_a_usage_error() -> None:
    result = CliRunner().invoke(main, ["bench", "--peer", "ollama"])
    assert result.exit_code == exit_codes.USAGE
    assert "llama.cpp" in result.output


def test_a_peer_that_cannot_be_built_leaves_the_spark_edge_arms_measured(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The arms run, the table and JSON are written, the peer's one line is printed, and the exit code says so."""
    monkeypatch.setenv("SPARK_EDGE_HOME", str(tmp_path))
    ran: list[list[str]] = []

    def no_peer(model):
        raise peer_build.PeerUnavailable("llama.cpp peer: cmake not found; building llama.cpp needs cmake")

    def fake_passes(arms, *args, **kwargs):
        ran.append(list(arms))
        return {tag: [_result(tag, 20.0, 200.0)] for tag in arms}

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text('{"vocab_size": 100}')
    monkeypatch.setattr(bench_command, "_peer_arm", no_peer)
    monkeypatch.setattr("spark_edge.bench.runner.run_passes", fake_passes)
    monkeypatch.setattr(bench_command, "arm_checkpoint", lambda *a, **k: tmp_path / "ckpt")
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(main, ["bench", "--peer", "llama.cpp", "--no-fidelity", "--out", str(out)])
    assert result.exit_code == exit_codes.PEER, result.output
    assert ran == [["bf16", "w4a16"]]
    assert out.is_file() and "cmake not found" in out.read_text()
    assert "error: llama.cpp peer: cmake not found" in result.output


def test_a_folder_that_build_made_serves_its_own_weight_path_only(bf16_checkpoint: Path) -> None:
    """bench --model takes a built folder as serve does (as it is, for the weight path it was built for); another
    arm, or the peer's bf16 conversion of a 4-bit build, is a usage error before anything is measured."""
    assert bench_command.arm_checkpoint(bf16_checkpoint, "bf16", log=lambda _: None) == bf16_checkpoint
    result = CliRunner().invoke(main, ["bench", "--model", str(bf16_checkpoint), "--paths", "bf16,w4a16"])
    assert result.exit_code == exit_codes.USAGE
    assert "is a bf16 build: it serves the bf16 arm only, not w4a16" in result.output


def test_a_missing_model_is_one_line_and_exit_code_3(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        main, ["bench", "--model", str(tmp_path / "absent.gguf"), "--out", str(tmp_path / "bench.json")]
    )
    assert result.exit_code == exit_codes.CHECKPOINT
    assert f"spark-edge: error: {tmp_path / 'absent.gguf'}: no such file\n" in result.output
    assert "Traceback" not in result.output


def _result(tag: str, tg: float, pp: float, served_tg: float | None = None) -> ArmResult:
    r = ArmResult(tag, 10.0, 500 * MiB, 400 * MiB, pp, tg, 500 * MiB, "cold")
    if served_tg:
        r.served = {
            "tg128_tps": served_tg,
            "pp512_tps": pp,
            "concurrency": [{"streams": n, "aggregate_tps": served_tg * n, "ttft_p50_s": 0.1} for n in (1, 4, 8)],
        }
    return r


def test_ratios_against_the_peer_are_in_the_summary_and_the_table(offline_w4a16_figures: dict) -> None:
    peer = _result("llama.cpp", 40.0, 160.0, served_tg=38.0)
    peer.llama_bench = {
        "Q4_K_M": {"pp512_tps": 150.0, "pp512_stddev_tps": 2.0, "tg128_tps": 42.0, "tg128_stddev_tps": 1.0},
        "BF16": {"error": "llama-bench on m.BF16.gguf died with SIGSEGV: "},
    }
    results = {
        "bf16": [_result("bf16", 16.0, 128.0, 15.0)],
        "w4a16": [_result("w4a16", 22.0, 250.0, 19.0)],
        "llama.cpp": [peer],
    }
    summary = summarize(results, baseline="bf16", peer="llama.cpp")
    summary["offline"] = {"w4a16": offline_w4a16_figures}
    assert summary["arms"]["w4a16"]["vs_peer"]["tg128_tps"] == pytest.approx(22.0 / 40.0)
    assert summary["arms"]["w4a16"]["vs_peer"]["pp512_tps"] == pytest.approx(250.0 / 160.0)
    assert "vs_peer" not in summary["arms"]["llama.cpp"]
    assert summary["peer"]["llama_bench"]["Q4_K_M"]["tg128_tps"] == 42.0
    table = format_table(summary)
    assert "vs llama.cpp" in table
    assert "tg128 0.50x" in table  # w4a16 streamed 19 against the peer's 38
    assert "llama-bench BF16: failed: llama-bench on m.BF16.gguf died with SIGSEGV" in table
    assert "offline w4a16 (vLLM LLM, one process): tg128 33.0 tok/s (0.79x peer), 4 sequences 96.0 tok/s" in table


def _fake_llama_perplexity(bin_dir: Path, script: str) -> Peer:
    tool = bin_dir / "llama-perplexity"
    tool.write_text(f"#!/bin/sh\n{script}\n")
    tool.chmod(0o755)
    ggufs = {q: bin_dir / f"m.{q}.gguf" for q in ("Q4_K_M", "BF16")}
    return Peer(bin_dir, ggufs, threads=2, context=512, slots=1)


def test_llama_cpps_own_q4_k_m_ratio_comes_from_llama_perplexity_and_reaches_the_table(tmp_path: Path) -> None:
    # b11434 prints its result on stderr; the GGUF's name decides the figure here
    script = 'case "$2" in *Q4_K_M*) p=28.2;; *) p=26.5;; esac; echo "Final estimate: PPL = $p +/- 0.4" >&2'
    scored = peer_perplexity(_fake_llama_perplexity(tmp_path, script), tmp_path / "text", 512, 8)
    assert scored == {"Q4_K_M": 28.2, "BF16": 26.5, "q4_k_m_ratio": round(28.2 / 26.5, 4)}
    summary = summarize({"w4a16": [_result("w4a16", 22.0, 250.0)]}, baseline="w4a16")
    summary["peer"] = {"arm": "llama.cpp", "llama_bench": {}, "perplexity": scored}
    assert "llama-perplexity on the same text: Q4_K_M 28.200, BF16 26.500 (Q4_K_M x1.064" in format_table(summary)


def test_a_llama_perplexity_that_fails_is_recorded_not_raised(tmp_path: Path) -> None:
    peer = _fake_llama_perplexity(tmp_path, "echo 'failed to load model' >&2; exit 1")
    scored = peer_perplexity(peer, tmp_path / "text", 512, 8)
    assert scored == {"error": "llama-perplexity on m.Q4_K_M.gguf exited with 1: failed to load model"}


@pytest.mark.peer
def test_llama_cpp_built_here_serves_the_default_models_gguf_and_knows_paris(
    bf16_checkpoint: Path, spark_edge_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The peer as the bench runs it: built for this host, the default model converted, served by llama-server."""
    import platform
    import subprocess

    import requests

    from spark_edge.bench.server_arm import _stop, _wait_ready, free_port
    from spark_edge.probe.device import probe_device

    monkeypatch.setenv("SPARK_EDGE_HOME", str(spark_edge_home))
    bin_dir = peer_build.ensure_built(probe_device().features, platform.machine(), log=print)
    ggufs = peer_build.ensure_ggufs(bin_dir, bf16_checkpoint, log=print)
    peer = Peer(bin_dir, {"Q8_0": ggufs["Q8_0"]}, threads=2, context=512, slots=1)
    port = free_port()
    launch = llama_server_launch(peer, port, {})
    proc = subprocess.Popen(launch.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_ready(proc, f"http://127.0.0.1:{port}", 300)
        body = {
            "model": launch.model,
            "prompt": "The capital of France is",
            "max_tokens": 1,
            "temperature": 0,
            "logprobs": 5,
        }
        reply = requests.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        # llama-server answers in the chat API's logprobs shape: content[i].top_logprobs, a list
        entries = reply.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
        top = {e["token"]: e["logprob"] for e in entries}
        assert " Paris" in top and top[" Paris"] >= -2.5, top
    finally:
        _stop(proc)
    # the fidelity gate's second term, as the bench measures it: Q4_K_M over BF16, both from llama.cpp
    text = Path("/usr/share/common-licenses/GPL-3")
    scored = peer_perplexity(Peer(bin_dir, ggufs, threads=2, context=512, slots=1), text, 512, 2)
    assert 1.0 < scored["q4_k_m_ratio"] < 1.3, scored


def test_a_failed_offline_arm_reports_the_engines_own_error_line(tmp_path: Path) -> None:
    from spark_edge.bench.offline import engine_error

    log = tmp_path / "offline.log"
    log.write_text(
        "INFO loading\nTraceback (most recent call last):\n  File x\n"
        "ValueError: 0.38 GiB KV cache is needed, which is larger than the available KV cache memory "
        "(0.23 GiB)\n\n"
    )
    assert engine_error(log).startswith("ValueError: 0.38 GiB KV cache is needed")


def test_the_offline_arm_sizes_its_kv_cache_like_the_served_plan(tmp_path: Path) -> None:
    """Every sequence at full context, as `serve`'s plan gives it (a fixed 256 MiB failed at 1.7 B)."""
    from spark_edge.bench.offline import kv_cache_bytes

    config = {
        "hidden_size": 2048,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "intermediate_size": 8192,
        "vocab_size": 49152,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    per_token = 24 * 32 * 64 * 2 * 2  # layers x KV heads x head dim x (K, V) x bf16
    assert kv_cache_bytes(str(tmp_path)) >= 2048 * 4 * per_token
