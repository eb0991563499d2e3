"""The memory plan: its arithmetic, its choices under a ceiling, and its refusal."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from spark_edge import exit_codes
from spark_edge.cli import main
from spark_edge.environment import DISABLED_KERNELS
from spark_edge.errors import SettingRefused, UnsupportedHostError
from spark_edge.planning.memory_plan import (
    MIN_CONTEXT,
    MIN_PREFILL_CHUNK,
    PREFILL_CHUNK_TOKENS,
    PROMPT_LOGPROBS_BYTES_PER_LOGIT,
    MemoryPlan,
    MiB,
    PlanRefused,
    activation_bytes,
    kv_bytes_for,
    logits_transient_bytes,
    make_plan,
    resident_weight_bytes,
)
from spark_edge.planning.model_shape import ModelShape
from spark_edge.planning.weight_bytes import weight_bytes
from spark_edge.probe.memory import MemoryBudget

SMOLLM2 = ModelShape(
    layers=30, hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64, vocab=49152, tied_embeddings=True
)
# Spark-X2.5-1.7B as the reference facts give it (fused QKV and the head gate aside)
SPARK = ModelShape(
    layers=28, hidden=2048, intermediate=6656, heads=8, kv_heads=2, head_dim=256, vocab=131072, tied_embeddings=True
)


def test_kv_bytes_per_token() -> None:
    assert SMOLLM2.kv_bytes_per_token() == 30 * 3 * 64 * 2 * 2
    assert SPARK.kv_bytes_per_token() == 56 * 1024  # 56 KiB/token, as measured on vLLM's CPU backend
    assert kv_bytes_for(SMOLLM2, 1) == kv_bytes_for(SMOLLM2, 128)  # whole blocks
    # one block more than the tokens fill: vLLM's block pool keeps one as its null block
    assert kv_bytes_for(SMOLLM2, 4096) == (4096 // 128 + 1) * 128 * SMOLLM2.kv_bytes_per_token()


def test_bf16_weight_bytes_match_the_built_checkpoint(bf16_checkpoint: Path) -> None:
    config = json.loads((bf16_checkpoint / "config.json").read_text())
    assert ModelShape.from_config(config) == SMOLLM2
    on_disk = (bf16_checkpoint / "model.safetensors").stat().st_size
    assert abs(weight_bytes(SMOLLM2, "bf16", 32) - on_disk) / on_disk < 0.001


def test_4bit_paths_are_about_a_quarter_of_bf16() -> None:
    bf16 = weight_bytes(SPARK, "bf16", 128)
    assert 3.3e9 < bf16 < 3.5e9  # "bf16 weights 3.42 GB"
    # the linears at 4.25 bits, Spark's 131072 x 2048 table at 8 (w4a16's int8 vocabulary table)
    table = SPARK.vocab * SPARK.hidden
    assert 0.25 < (weight_bytes(SPARK, "w4a16", 128) - table) / (bf16 - 2 * table) < 0.28
    assert 0.29 < weight_bytes(SPARK, "w4a16", 128) / bf16 < 0.32
    # w4a8 keeps a bf16 embedding table beside the 4-bit head
    assert weight_bytes(SPARK, "w4a8", 128) > weight_bytes(SPARK, "w4a16", 128)


SMOLLM2_1_7B = ModelShape(
    layers=24, hidden=2048, intermediate=8192, heads=32, kv_heads=32, head_dim=64, vocab=49152, tied_embeddings=True
)


def test_resident_bf16_weights_follow_the_vocabulary_table_not_the_checkpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured settled bf16 weights (an AMD EPYC Zen 4, docs/memory-plan.md): 359 MiB for the default model's
    257 MiB checkpoint, 3649 MiB for the 1.7B shape's 3264 MiB. The plan must bound both within 15%."""
    from spark_edge.planning import memory_plan

    monkeypatch.setattr(memory_plan, "host_has_bf16_gemm", lambda: True)
    for shape, measured in ((SMOLLM2, 359 * MiB), (SMOLLM2_1_7B, 3649 * MiB)):
        planned = resident_weight_bytes(shape, "bf16", 32)
        assert measured <= planned < 1.15 * measured, (shape, planned / MiB)
    # w4a16's 8-bit table: where integer dot products exist but vLLM's packed int8 GEMM does not run (AVX-VNNI
    # only, or that GEMM disabled), oneDNN's int8 head packs its own copy of the codes beside the mapped rows;
    # the packed GEMM (AVX512-VNNI) shares one packed table, and without dot products the rows are read as they are
    table_copy = SMOLLM2_1_7B.vocab * SMOLLM2_1_7B.hidden
    for packed, vnni, extra in ((True, True, 0), (False, True, table_copy), (False, False, 0)):
        monkeypatch.setattr(memory_plan, "host_runs_packed_int8_gemm", lambda packed=packed: packed)
        monkeypatch.setattr(memory_plan, "host_has_int8_dot", lambda vnni=vnni: vnni)
        assert resident_weight_bytes(SMOLLM2_1_7B, "w4a16", 32) == weight_bytes(SMOLLM2_1_7B, "w4a16", 32) + extra
    monkeypatch.setattr(memory_plan, "host_runs_packed_int8_gemm", lambda: True)
    monkeypatch.setattr(memory_plan, "host_has_int8_dot", lambda: True)
    monkeypatch.setenv(DISABLED_KERNELS.name, "int8_packed_gemm")  # the bench's onednn-head variant
    assert resident_weight_bytes(SMOLLM2_1_7B, "w4a16", 32) == weight_bytes(SMOLLM2_1_7B, "w4a16", 32) + table_copy
    monkeypatch.setattr(memory_plan, "host_has_bf16_gemm", lambda: False)  # oneDNN converts bf16 itself
    assert resident_weight_bytes(SMOLLM2, "bf16", 32) > 2 * weight_bytes(SMOLLM2, "bf16", 32)


def test_ample_memory_gets_what_was_asked() -> None:
    plan = make_plan(SMOLLM2, "w4a16", 16 << 30, 2048, max_num_seqs=4)
    assert (plan.max_model_len, plan.kv_tokens, plan.reduced_context) == (2048, 4 * 2048, False)
    assert plan.load_peak_bytes > plan.steady_bytes > plan.weights_bytes


def test_the_plan_marks_its_weights_file_backed() -> None:
    """Mapped once loaded (runtime/mapped_weights.py): the steady figure splits into anonymous memory and
    the weights' file-backed pages, which stay in every sum because the cgroup charges them."""
    plan = make_plan(SMOLLM2, "w4a16", 16 << 30, 2048, max_num_seqs=4)
    d = plan.as_dict()
    assert d["file_backed_bytes"] == plan.weights_bytes > 0
    assert d["steady_anon_bytes"] + d["file_backed_bytes"] == d["steady_bytes"]
    assert f"weights {plan.weights_bytes / MiB:.0f} MiB file-backed" in plan.summary()


def _ceiling_for(peak_bytes: int) -> int:
    """The ceiling whose budget (ceiling minus 10% headroom) just holds this peak."""
    return int((peak_bytes + 20 * MiB) / 0.9)


def test_a_tight_ceiling_shrinks_the_prefill_chunk_then_kv_then_context() -> None:
    full = make_plan(SMOLLM2, "bf16", 16 << 30, 8192, max_num_seqs=4)
    assert (full.max_num_batched_tokens, full.kv_tokens) == (PREFILL_CHUNK_TOKENS, 4 * 8192)
    # a prompt_logprobs step is planned: logits for 512 tokens x 49152 words x 12 bytes above steady
    assert full.logits_transient_bytes == PREFILL_CHUNK_TOKENS * SMOLLM2.vocab * PROMPT_LOGPROBS_BYTES_PER_LOGIT
    assert full.peak_bytes == full.serving_peak_bytes > full.load_peak_bytes > full.steady_bytes
    # 100 MiB short of the full plan: a smaller prefill chunk, every sequence's KV kept
    chunked = make_plan(SMOLLM2, "bf16", _ceiling_for(full.peak_bytes - 100 * MiB), 8192, max_num_seqs=4)
    assert chunked.reduced_prefill_chunk and chunked.kv_tokens == 4 * 8192 and not chunked.reduced_context
    assert "prefill chunk 256 tokens (reduced from 512 to fit)" in chunked.summary()
    # room for the smallest chunk and about one full-length sequence, not four
    smallest_chunk = _plan_with_chunk(full, MIN_PREFILL_CHUNK)
    one_seq = smallest_chunk.peak_bytes - smallest_chunk.kv_bytes + kv_bytes_for(SMOLLM2, 8192, 1, MIN_PREFILL_CHUNK)
    plan = make_plan(SMOLLM2, "bf16", _ceiling_for(one_seq), 8192, max_num_seqs=4)
    assert plan.fits and plan.max_model_len == 8192 and plan.kv_tokens < 4 * 8192
    assert plan.max_num_batched_tokens == MIN_PREFILL_CHUNK
    smaller = make_plan(SMOLLM2, "bf16", _ceiling_for(one_seq) - 150 * MiB, 8192, max_num_seqs=4)
    assert smaller.fits and smaller.reduced_context and smaller.max_model_len < 8192


def _plan_with_chunk(plan: MemoryPlan, chunk: int) -> MemoryPlan:
    """The same plan with another prefill chunk (its activations and sliding KV follow)."""
    return replace(
        plan,
        max_num_batched_tokens=chunk,
        activation_bytes=activation_bytes(SMOLLM2, chunk, plan.max_num_seqs),
        logits_transient_bytes=logits_transient_bytes(SMOLLM2, chunk),
    )


def test_too_small_a_ceiling_is_refused_with_numbers() -> None:
    with pytest.raises(PlanRefused, match=rf"even a {MIN_CONTEXT}-token context needs a peak of \d+ MiB"):
        make_plan(SPARK, "bf16", 2 << 30, 4096)


def test_plan_command_refuses_with_exit_code_and_json(bf16_checkpoint: Path) -> None:
    result = CliRunner().invoke(
        main,
        ["plan", "--model", str(bf16_checkpoint), "--weight-path", "bf16", "--memory-limit", str(512 * MiB), "--json"],
    )
    assert result.exit_code == exit_codes.MEMORY
    out = json.loads(result.stdout)
    assert out["fits"] is False and out["peak_bytes"] > out["budget_bytes"]
    ok = CliRunner().invoke(main, ["plan", "--model", str(bf16_checkpoint), "--weight-path", "bf16", "--json"])
    assert ok.exit_code == 0 and json.loads(ok.stdout)["fits"] is True


# --- the ceiling a server plans under ---------------------------------------------------------------


def _budget(limit: int | None, used: int | None, available: int = 20 << 30) -> MemoryBudget:
    ceiling = available if limit is None else min(available, limit - (used or 0))
    return MemoryBudget(24 << 30, available, limit, used, ceiling)


def test_serving_ceiling_gives_back_what_the_serving_process_already_holds() -> None:
    from spark_edge.planning.ceiling import OwnMemory, serving_ceiling

    # the cgroup holds 150 MiB, 140 MiB of it this process's own (it becomes the API server)
    ceiling = serving_ceiling(_budget(2048 * MiB, 150 * MiB), own=OwnMemory(140 * MiB, 0))
    assert ceiling.bytes == (2048 - 10) * MiB
    assert "cgroup limit 2048 MiB, 150 MiB of it in use, 140 MiB of that by this process" in ceiling.describe()
    # never more than the cgroup counts as used, whatever the process reports
    assert serving_ceiling(_budget(2048 * MiB, 100 * MiB), own=OwnMemory(900 * MiB, 0)).bytes == 2048 * MiB
    # and never more than the host has
    assert serving_ceiling(_budget(8 << 30, 0, available=1 << 30), own=OwnMemory(0, 0)).bytes == 1 << 30


def test_serving_ceiling_gives_back_the_pages_of_its_libraries_only_where_the_cgroup_was_charged_for_them() -> None:
    """The first container on a node is charged for the pages of torch's libraries, the next ones are not (another
    cgroup read them first): the ceiling, and the smallest limit a plan accepts, must be the same in both."""
    from spark_edge.planning.ceiling import OwnMemory, serving_ceiling

    own = OwnMemory(anon=144 * MiB, file=75 * MiB)
    first = MemoryBudget(24 << 30, 20 << 30, 2048 * MiB, 229 * MiB, (2048 - 229) * MiB, cgroup_mapped=75 * MiB)
    later = MemoryBudget(24 << 30, 20 << 30, 2048 * MiB, 154 * MiB, (2048 - 154) * MiB, cgroup_mapped=0)
    assert serving_ceiling(first, own=own).bytes == serving_ceiling(later, own=own).bytes == (2048 - 10) * MiB
    # mapped pages of other processes in the cgroup stay theirs
    crowded = MemoryBudget(24 << 30, 20 << 30, 2048 * MiB, 429 * MiB, (2048 - 429) * MiB, cgroup_mapped=275 * MiB)
    assert serving_ceiling(crowded, own=own).bytes == (2048 - 210) * MiB


def test_serving_ceiling_on_the_host_and_from_the_command_line() -> None:
    from spark_edge.planning.ceiling import OwnMemory, serving_ceiling

    host = serving_ceiling(_budget(None, None, available=10 << 30), own=OwnMemory(200 * MiB, 0))
    assert host.bytes == (10 << 30) + 200 * MiB and "host memory available" in host.source
    explicit = serving_ceiling(_budget(2048 * MiB, 150 * MiB), explicit=3 << 30, own=OwnMemory(140 * MiB, 0))
    assert (explicit.bytes, explicit.source) == (3 << 30, "--memory-limit")


# -- the baseline calibrated per host (planning/calibration.py) ------------------------------------


def test_a_load_peak_over_the_plan_calibrates_the_next_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from spark_edge.planning.calibration import calibrated_baseline, record_load_peak
    from spark_edge.planning.memory_plan import RUNTIME_BASELINE_BYTES

    monkeypatch.setenv("SPARK_EDGE_HOME", str(tmp_path))
    here, elsewhere = ["avx2", "avx512f", "fma"], ["avx2", "fma"]
    assert calibrated_baseline(here, "w4a16", "engine") is None
    first = make_plan(SMOLLM2, "w4a16", 16 << 30, 2048)
    measured = first.load_peak_bytes + 210 * MiB  # what an AMD Zen 4 host measured over the Intel-made constant
    assert record_load_peak(here, first, "engine", measured, "a CPU") == first.baseline_bytes + 210 * MiB
    second = make_plan(
        SMOLLM2, "w4a16", 16 << 30, 2048, calibrated_baseline=calibrated_baseline(here, "w4a16", "engine")
    )
    assert second.load_peak_bytes == measured  # an upper bound from now on, on this host only
    assert calibrated_baseline(elsewhere, "w4a16", "engine") is None
    assert calibrated_baseline(here, "bf16", "engine") is None and calibrated_baseline(here, "w4a16", "split") is None
    # records only grow, and a plan never goes below the constant
    assert record_load_peak(here, first, "engine", first.load_peak_bytes, "a CPU") == first.baseline_bytes + 210 * MiB
    low = make_plan(SMOLLM2, "w4a16", 16 << 30, 2048, calibrated_baseline=1)
    assert low.baseline_bytes == RUNTIME_BASELINE_BYTES["engine"]


def test_an_unreadable_calibration_is_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from spark_edge.planning.calibration import _path, calibrated_baseline

    monkeypatch.setenv("SPARK_EDGE_HOME", str(tmp_path))
    path = _path(["avx2"], "bf16", "engine")
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert calibrated_baseline(["avx2"], "bf16", "engine") is None


def test_plan_reads_serves_variables_as_serve_does(bf16_checkpoint: Path) -> None:
    """In a pod's environment `plan` prints the plan `serve` runs with: the same settings, variables included."""
    env = {"SPARK_EDGE_MAX_MODEL_LEN": "1024", "SPARK_EDGE_MAX_NUM_SEQS": "2", "SPARK_EDGE_WEIGHT_PATH": "bf16"}
    result = CliRunner().invoke(main, ["plan", "--model", str(bf16_checkpoint), "--json"], env=env)
    assert result.exit_code == 0, result.output
    planned = json.loads(result.stdout)
    assert (planned["max_model_len"], planned["max_num_seqs"], planned["weight_path"]) == (1024, 2, "bf16")
    bad = CliRunner().invoke(main, ["plan", "--model", str(bf16_checkpoint)], env={"SPARK_EDGE_MAX_NUM_SEQS": "x"})
    assert bad.exit_code == exit_codes.USAGE and "SPARK_EDGE_MAX_NUM_SEQS" in bad.output


# --- the KV cache's dtype ---------------------------------------------------------------------------


def _device(tmp_path: Path, kind: str):
    from test_probe import device_tree

    from spark_edge.probe.device import probe_device

    return probe_device(device_tree(tmp_path / kind, kind), machine="x86_64")


def test_an_fp8_kv_cache_plans_half_the_bytes() -> None:
    bf16 = make_plan(SMOLLM2, "w4a16", 16 << 30, 8192, max_num_seqs=4)
    fp8 = make_plan(SMOLLM2, "w4a16", 16 << 30, 8192, max_num_seqs=4, kv_dtype="fp8")
    assert fp8.kv_bytes * 2 == bf16.kv_bytes and fp8.kv_cache_dtype == "fp8"
    assert "(fp8) for 32768 tokens" in fp8.summary()


def test_auto_takes_fp8_only_where_bf16_would_cut_the_context(bf16_checkpoint: Path, tmp_path: Path) -> None:
    from spark_edge.planning.ceiling import Ceiling
    from spark_edge.planning.serving_plan import serving_plan

    config = json.loads((bf16_checkpoint / "config.json").read_text())
    zen4 = _device(tmp_path, "zen4")

    def plan(ceiling: int, kv: str, device=zen4) -> MemoryPlan:
        return serving_plan(device, config, "bf16", Ceiling(ceiling, "test"), 8192, 4, "engine", kv)

    ample = plan(16 << 30, "auto")
    assert ample.kv_cache_dtype == "bf16" and not ample.reduced_context
    # a ceiling under which bf16 serves a shorter context than asked: fp8 serves a longer one
    full = plan(16 << 30, "bf16")
    tight = full.peak_bytes - full.kv_bytes + int(0.15 * full.kv_bytes)  # 0.6 of one full-length bf16 sequence
    assert plan(_ceiling_for(tight), "bf16").reduced_context
    chosen = plan(_ceiling_for(tight), "auto")
    assert chosen.kv_cache_dtype == "fp8"
    assert chosen.max_model_len > plan(_ceiling_for(tight), "bf16").max_model_len
    # where fp8 cannot run (AVX2 only), auto stays bf16 and an explicit fp8 is refused with exit 4
    haswell = _device(tmp_path, "haswell")
    assert plan(_ceiling_for(tight), "auto", haswell).kv_cache_dtype == "bf16"
    with pytest.raises(UnsupportedHostError, match="AVX-512 or AMX"):
        plan(16 << 30, "fp8", haswell)


def test_an_fp8_kv_cache_for_a_head_size_vllm_cannot_store_is_exit_2(bf16_checkpoint: Path, tmp_path: Path) -> None:
    from spark_edge.planning.ceiling import Ceiling
    from spark_edge.planning.serving_plan import serving_plan

    config = json.loads((bf16_checkpoint / "config.json").read_text())
    odd = {**config, "head_dim": 80}  # a multiple of 16, not of 32: vLLM's CPU attention refuses fp8 there
    with pytest.raises(SettingRefused, match="multiple of 32") as refused:
        serving_plan(_device(tmp_path, "zen4"), odd, "bf16", Ceiling(16 << 30, "test"), 2048, 4, "engine", "fp8")
    assert refused.value.exit_code == exit_codes.USAGE


def test_plan_command_takes_the_kv_cache_dtype(bf16_checkpoint: Path) -> None:
    args = ["plan", "--model", str(bf16_checkpoint), "--kv-cache-dtype", "fp8", "--json"]
    result = CliRunner().invoke(main, args)
    if result.exit_code == exit_codes.UNSUPPORTED_HOST:  # this host has no AVX-512: refused, saying why
        assert "AVX-512 or AMX" in result.output
        return
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["kv_cache_dtype"] == "fp8"
