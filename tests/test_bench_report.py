"""docs/benchmarks.md is generated from bench JSON: every figure in it comes from the file, with its host."""

from __future__ import annotations

import json
from pathlib import Path

from spark_edge.bench.report import render
from spark_edge.bench.runner import summarize, write_json
from spark_edge.bench.server_arm import ArmResult

MiB = 1 << 20


def _arm(tag: str, tg: float, pp: float, streamed: float) -> ArmResult:
    r = ArmResult(tag, 12.5, 600 * MiB, 500 * MiB, pp, tg, 600 * MiB, "cold")
    r.served = {
        "tg128_tps": streamed,
        "grounded_tg128_tps": streamed * 2,
        "pp512_tps": pp,
        "concurrency": [
            {"streams": n, "aggregate_tps": streamed * n * 0.9, "ttft_p50_s": 0.05 * n, "ttft_p95_s": 0.08 * n}
            for n in (1, 4, 8)
        ],
    }
    return r


def test_the_document_carries_each_runs_host_figures_and_peer(tmp_path: Path, offline_w4a16_figures: dict) -> None:
    peer = _arm("llama.cpp", 40.0, 160.0, 38.0)
    peer.llama_bench = {
        "Q4_K_M": {"pp512_tps": 150.0, "pp512_stddev_tps": 2.0, "tg128_tps": 42.0, "tg128_stddev_tps": 1.0}
    }
    failed = ArmResult("w4a8", 0, 0, 0, 0, 0, 0, "failed", errors=["engine died"])
    results = {
        "bf16": [_arm("bf16", 16.0, 128.0, 15.0)],
        "w4a16": [_arm("w4a16", 22.0, 250.0, 19.0)],
        "w4a8": [failed],
        "llama.cpp": [peer],
    }
    summary = summarize(results, "bf16", peer="llama.cpp")
    summary["arms"]["bf16"].update(perplexity=10.0)  # fidelity as summarize() writes it for scored arms
    summary["arms"]["bf16"].update(perplexity_ratio=1.0, top1_agreement=1.0)
    summary.update(model="default", host="Intel(R) Xeon(R) Processor @ 2.00GHz, 2 usable cores, features: avx2")
    summary["offline"] = {"w4a16": offline_w4a16_figures, "bf16": {"error": "ValueError: no KV cache"}}
    path = tmp_path / "run.json"
    write_json(summary, path)
    text = render([path])
    assert "## default on Intel(R) Xeon(R) Processor @ 2.00GHz" in text
    assert (
        "| w4a16 | 22.0 | 250 | 19.0 | 38.0 | 17.1 / 68.4 / 136.8 | 200 / 320 | 600 | 500 | 12.5 | 0.55x | - | - |"
        in text
    )
    assert "| w4a8 | failed |" in text
    assert "| 12.5 | 0.40x | x1.000 | 1.000 |" in text  # bf16: 16 tok/s against the peer's 40, its own fidelity
    assert "| Q4_K_M | 150.0 ± 2.0 | 42.0 ± 1.0 |" in text
    assert "| w4a16 | 33.0 | 96.0 (N=4) | 280 | spark_edge::int4_linear 11.50 |" in text
    assert "failed: ValueError: no KV cache" in text
    assert "one pass: a smoke run" in text
    assert "Forced" not in text
    json.loads(path.read_text())  # the source stays valid JSON

    forced = tmp_path / "forced.json"  # bench --isa avx2: the section says whose speed it is
    write_json({**summary, "forced_isa": "avx2"}, forced)
    assert "Forced avx2: every arm ran its avx2 kernels on this machine" in render([forced])


def test_the_newest_full_run_per_host_and_model_comes_first_and_the_rest_are_listed(tmp_path: Path) -> None:
    def run(name: str, host: str, tg: float, peer: bool, streamed: bool = True) -> Path:
        results = {"w4a16": [_arm("w4a16", tg, 250.0, tg)]}
        if peer:
            results["llama.cpp"] = [_arm("llama.cpp", 40.0, 160.0, 38.0)]
        for arm in results.values() if not streamed else ():
            arm[0].served = {}
        summary = summarize(results, "w4a16", peer="llama.cpp" if peer else None)
        summary.update(model="default", host=f"{host}, 2 usable cores")
        write_json(summary, tmp_path / name)
        return tmp_path / name

    paths = [
        run("1-zen4.json", "AMD EPYC", 10.0, True),
        run("2-xeon.json", "Intel Xeon", 20.0, True),
        run("3-zen4.json", "AMD EPYC", 30.0, True),
        run("4-zen4-variant.json", "AMD EPYC", 40.0, False),
        run("5-zen4-gate.json", "AMD EPYC", 50.0, True, streamed=False),  # the peer, but not --served
    ]
    text = render(paths)
    sections = [line for line in text.splitlines() if line.startswith("From `")]
    assert [s.split("`")[1] for s in sections] == ["3-zen4.json", "2-xeon.json"]
    listed = text.split("## Earlier and targeted runs", 1)[1]
    assert "`4-zen4-variant.json`" in listed and "targeted (no peer)" in listed
    assert "`5-zen4-gate.json`" in listed and "targeted (not streamed)" in listed
    assert "`1-zen4.json`" in listed and "superseded" in listed
    assert "| w4a16 | 10.0 |" not in text  # the superseded run's figures are in its JSON only
