"""The default model on the W4A16 cpu_int4 path, through the real engine, against bf16."""

from __future__ import annotations

from pathlib import Path

import pytest

from spark_edge.bench.fidelity import score, text_chunks, top1_agreement
from spark_edge.checkpoints.default_model import DEFAULT_MODEL_ID

from conftest import Server

pytestmark = pytest.mark.engine

# Issue 3's target: perplexity within +10% of bf16 (the default model's weights sit on a
# Q4_1 grid of 32, so w4a16 at group 32 can reach it; this says nothing of high-precision weights).
MAX_PERPLEXITY_RATIO = 1.10


def test_w4a16_knows_paris(w4a16_server: Server) -> None:
    w4a16_server.assert_knows_paris(DEFAULT_MODEL_ID)


def test_w4a16_runs_through_cpu_int4(w4a16_server: Server) -> None:
    log = w4a16_server.log_path.read_text(errors="replace")
    assert "quantization=cpu_int4" in log
    assert "weight path: w4a16" in log
    # the C++ kernels loaded and passed their self-check inside vLLM (else the slower torch paths serve)
    assert "native int4 kernels unavailable" not in log, log[-4000:]


def test_w4a16_batched_requests_take_the_multi_row_path(w4a16_server: Server) -> None:
    w4a16_server.assert_knows_paris(DEFAULT_MODEL_ID, prompts=2)


def test_w4a16_perplexity_and_top1_against_bf16(
    bf16_server: Server, w4a16_server: Server, bf16_checkpoint: Path
) -> None:
    windows = text_chunks(bf16_checkpoint)
    ref = score(bf16_server.url, DEFAULT_MODEL_ID, windows, bf16_server.headers)
    quant = score(w4a16_server.url, DEFAULT_MODEL_ID, windows, w4a16_server.headers)
    ratio = quant.perplexity / ref.perplexity
    agreement = top1_agreement(ref, quant)
    print(
        f"perplexity bf16 {ref.perplexity:.3f}, w4a16 {quant.perplexity:.3f} (x{ratio:.3f}); "
        f"top-1 agreement {agreement:.3f} over {len(ref.top1)} positions"
    )
    assert ratio <= MAX_PERPLEXITY_RATIO


def test_plan_predicts_the_measured_w4a16_load_peak(w4a16_server: Server) -> None:
    import json

    from prometheus_client.parser import text_string_to_metric_families

    from spark_edge.planning.memory_plan import make_plan
    from spark_edge.planning.model_shape import ModelShape
    from spark_edge.serving.process_layout import DEFAULT_LAYOUT

    text = w4a16_server.get("/metrics").text
    m = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    config_path = next(p for p in Path(w4a16_server.home).glob("checkpoints/*-w4a16/config.json"))
    config = json.loads(config_path.read_text())
    plan = make_plan(
        ModelShape.from_config(config),
        "w4a16",
        int(m["spark_edge_memory_limit_bytes"]),
        2048,
        4,
        config["quantization_config"]["group_size"],
        DEFAULT_LAYOUT,
    )
    measured = m["spark_edge_load_rss_anon_peak_bytes"]
    print(f"w4a16 plan load peak {plan.load_peak_bytes / 2**20:.0f} MiB, measured {measured / 2**20:.0f} MiB")
    assert measured <= m["spark_edge_plan_load_peak_bytes"]  # the plan it ran with: this start compiled
    assert abs(plan.load_peak_bytes - measured) / measured <= 0.15  # the plan without the compiler
