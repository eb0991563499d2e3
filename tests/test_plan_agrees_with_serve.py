"""`spark-edge plan` prints the plan `spark-edge serve` runs with, for the same options: bf16 and a w4a16
build whose manifest names its weight path (taken over the probe's pick, as serve takes it), with and
without a memory limit. Serve's side is its own preparation (probe, checkpoint, plan), stopped before vLLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from spark_edge.cli import plan as plan_command
from spark_edge.serving.serve import ServeRequest, prepare
from spark_edge.weight_paths.builder import build_checkpoint

GiB = 1 << 30


@pytest.fixture(scope="module")
def w4a16_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(None, "w4a16", tmp_path_factory.mktemp("built") / "w4a16").out


def _serve_plan(model: Path, limit: int | None) -> dict:
    req = ServeRequest(
        model=model,
        weight_path="auto",
        priority="speed",
        host="127.0.0.1",
        port=8000,
        max_model_len=2048,
        max_num_seqs=4,
        memory_limit=limit,
    )
    prepared = prepare(req, log=lambda _: None)
    prepared.sampler.stop()
    return prepared.plan.as_dict()


def _plan_command(model: Path, limit: int | None) -> dict:
    args = ["--model", str(model), "--max-model-len", "2048", "--max-num-seqs", "4", "--json"]
    result = CliRunner().invoke(plan_command, args + (["--memory-limit", str(limit)] if limit else []))
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("which", ["bf16", "w4a16"])
@pytest.mark.parametrize("limit", [None, 3 * GiB])
def test_plan_prints_the_plan_serve_runs_with(
    which: str,
    limit: int | None,
    bf16_checkpoint: Path,
    w4a16_build: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SPARK_EDGE_HOME", str(tmp_path))  # serve's run folder and calibration: this test's own
    model = bf16_checkpoint if which == "bf16" else w4a16_build
    served = _serve_plan(model, limit)
    planned = _plan_command(model, limit)
    assert served["weight_path"] == which  # the build's own path, whatever the probe would pick
    if limit is None:  # each process measured the free memory and its own RSS at its own moment
        assert planned.pop("ceiling_bytes") == pytest.approx(served.pop("ceiling_bytes"), rel=0.05)
        for follows_the_ceiling in ("headroom_bytes", "budget_bytes"):
            planned.pop(follows_the_ceiling), served.pop(follows_the_ceiling)
    assert planned == served
