"""N-gram speculation as a setting: what vLLM is told, and the room the plan keeps for the drafts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from spark_edge.cli import main
from spark_edge.planning.compile_state import compile_key
from spark_edge.planning.memory_plan import MIN_PREFILL_CHUNK, PlanRefused, make_plan
from spark_edge.planning.model_shape import ModelShape
from spark_edge.planning.speculation import (
    DRAFT_TOKENS,
    MAX_SPECULATING_SEQS,
    RUNTIME_BYTES,
    draft_tokens,
    vllm_speculative_config,
)

SMOLLM2 = ModelShape(
    layers=30, hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64, vocab=49152, tied_embeddings=True
)


def test_off_tells_vllm_nothing_and_ngram_its_prompt_lookup() -> None:
    assert draft_tokens("off") == 0 and vllm_speculative_config(draft_tokens("off")) is None
    config = json.loads(vllm_speculative_config(draft_tokens("ngram")) or "")
    assert config["method"] == "ngram" and config["num_speculative_tokens"] == DRAFT_TOKENS == draft_tokens("ngram")
    assert 1 <= config["prompt_lookup_min"] <= config["prompt_lookup_max"]
    # vLLM's own parser of the per-batch schedule takes it: drafts for a sequence or two, none beyond
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    lookup = build_dynamic_sd_schedule_lookup(config["num_speculative_tokens_per_batch_size"], 8, DRAFT_TOKENS)
    assert lookup[1:] == [DRAFT_TOKENS] * MAX_SPECULATING_SEQS + [0] * (8 - MAX_SPECULATING_SEQS)
    with pytest.raises(ValueError, match="unknown speculation"):
        draft_tokens("eagle")


def test_the_prefill_chunk_keeps_room_for_every_sequences_drafts() -> None:
    # 40 sequences with 4 drafts each: a decode step carries up to 200 tokens, so the chunk never drops below it
    seqs = 40
    plain = make_plan(SMOLLM2, "w4a16", 16 << 30, 2048, max_num_seqs=seqs)
    spec = make_plan(SMOLLM2, "w4a16", 16 << 30, 2048, max_num_seqs=seqs, draft_tokens=DRAFT_TOKENS)
    assert spec.draft_tokens == DRAFT_TOKENS and plain.draft_tokens == 0
    assert spec.baseline_bytes == plain.baseline_bytes + RUNTIME_BYTES  # the proposer's compiler, counted
    assert spec.max_num_batched_tokens >= seqs * (1 + DRAFT_TOKENS) > MIN_PREFILL_CHUNK
    assert f"up to {DRAFT_TOKENS} drafts" in spec.summary() and "drafts" not in plain.summary()
    # however tight the ceiling, down to where the plan refuses, the chunk never drops below that floor
    chunks = set()
    for ceiling in range(spec.peak_bytes + (64 << 20), 0, -(16 << 20)):
        try:
            tight = make_plan(SMOLLM2, "w4a16", ceiling, 2048, max_num_seqs=seqs, draft_tokens=DRAFT_TOKENS)
        except PlanRefused:
            break
        chunks.add(tight.max_num_batched_tokens)
    assert min(chunks) == 256 >= seqs * (1 + DRAFT_TOKENS)  # it shrank from 512, and stopped above 200


def test_speculation_is_part_of_the_compile_key_and_off_keeps_the_old_keys() -> None:
    base = ("/m", "w4a16", 8192, 8, 512, "bf16")
    assert compile_key(*base) == compile_key(*base, 0) != compile_key(*base, DRAFT_TOKENS)


def test_plan_and_serve_take_the_setting_and_its_variable(bf16_checkpoint: Path) -> None:
    args = ["plan", "--model", str(bf16_checkpoint), "--json"]
    result = CliRunner().invoke(main, args, env={"SPARK_EDGE_SPECULATION": "ngram"})
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["draft_tokens"] == DRAFT_TOKENS
    bad = CliRunner().invoke(main, [*args, "--speculation", "eagle"])
    assert bad.exit_code == 2 and "'eagle' is not one of" in bad.output
    assert "SPARK_EDGE_SPECULATION" in CliRunner().invoke(main, ["serve", "--help"]).output
