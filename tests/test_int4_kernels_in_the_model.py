"""The tile GEMMs inside the real model: the default model on w4a16 in vLLM's offline engine, run in this process
(no engine subprocess), so the int4 kernel policy can be switched between calls on one loaded, compiled engine.

Prefill rows go to this host's tile GEMM (AMX tiles, or vdpbf16ps tiles on AVX512-BF16 hosts without AMX); the
previous prefill path dequantized each whole weight to bf16 for oneDNN. Both multiply the same bf16 weights and
differ only in the order of their fp32 sums, so greedy tokens must agree, up to a near tie the rounding can tip.
Switching back and forth over many prefill and decode steps is also what interleaves the tile kernels with vLLM's
attention (AMX tiles on AMX hosts) and oneDNN: each must find the tile state it expects.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
import torch

from engine_lock import engine_lock
from spark_edge.checkpoints.builder import build_checkpoint
from spark_edge.quant import cpu_int4_op
from spark_edge.quant.tinygemm_layout import detect_layout

pytestmark = pytest.mark.engine

PROMPTS = (  # each one prefill of more rows than the tile GEMMs start at
    "The capital of France is a city that many people visit every year because",
    "Write a short story about a robot who learns to paint, in three sentences:",
    "Here is a list of the planets of the solar system, from the closest to the sun:",
)
NEW_TOKENS = 24
NEAR_TIE_NAT = 0.05  # two candidates this close in log-prob may swap on the order of fp32 sums
ROUNDS = 3  # host kernels, previous kernels, host kernels again: every switch crosses prefill and decode


def _configure(policy: cpu_int4_op.KernelPolicy) -> None:
    layout = detect_layout()
    torch.ops.spark_edge.int4_configure(layout.block, layout.halves, *policy)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    if not cpu_int4_op.native_linear_available() or not cpu_int4_op.host_policy().tiles:
        pytest.skip("no tile GEMM on this host (it prefills on dequantization + oneDNN already): nothing to compare")
    root = tmp_path_factory.mktemp("int4-model")
    checkpoint = build_checkpoint(None, "w4a16", root / "w4a16", {"group_size": 32}).out
    with pytest.MonkeyPatch.context() as mp, engine_lock():
        for key, value in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CACHE_ROOT": str(root / "vllm-cache"),
                           "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}.items():
            mp.setenv(key, value)
        mp.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
        from vllm import LLM

        llm = LLM(model=str(checkpoint), dtype="bfloat16", max_model_len=512, max_num_seqs=4,
                  kv_cache_memory_bytes=64 * 2**20, enable_prefix_caching=False, seed=0)
        try:
            yield llm
        finally:
            _configure(cpu_int4_op.host_policy())
            llm.llm_engine.engine_core.shutdown()


def _greedy(llm: object) -> list[tuple[list[int], list[dict[int, float]]]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=2)
    outs = llm.generate(list(PROMPTS), params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
            for o in outs]


def _agree(new: tuple[list[int], list[dict[int, float]]], old: tuple[list[int], list[dict[int, float]]]) -> None:
    """Identical tokens, or identical up to a step where the new run's two best candidates were a near tie."""
    (tokens, logprobs), (old_tokens, _) = new, old
    for i, (a, b) in enumerate(zip(tokens, old_tokens)):
        if a != b:
            gap = logprobs[i][a] - logprobs[i].get(b, float("-inf"))
            assert gap <= NEAR_TIE_NAT, f"step {i}: token {a} vs {b}, {gap:.3f} nat apart: not a near tie"
            return


def test_greedy_tokens_equal_the_previous_prefill_kernels(engine: object, monkeypatch: pytest.MonkeyPatch) -> None:
    host = cpu_int4_op.host_policy()
    monkeypatch.setenv(cpu_int4_op.TILES_SWITCH, "0")  # the previous prefill: dequantization + oneDNN
    previous = cpu_int4_op.host_policy()
    assert previous.tiles == 0 and host.tiles != 0
    runs = []
    for policy in [host, previous, host][:ROUNDS]:
        _configure(policy)
        runs.append(_greedy(engine))
    for new, old in zip(runs[0], runs[1]):
        _agree(new, old)
    # the same kernels after two switches: the same tokens (deterministic: tile state and caches restored)
    assert [tokens for tokens, _ in runs[2]] == [tokens for tokens, _ in runs[0]]


def test_the_tile_gemm_is_what_prefill_rows_take(engine: object) -> None:
    """Not a vacuous comparison: on this host each prompt alone (and the three prefilled together) has more rows
    than the tile GEMM starts at, on the model's own shapes."""
    tokenizer = engine.get_tokenizer()
    rows = [len(tokenizer.encode(prompt)) for prompt in PROMPTS]
    for m in (*rows, sum(rows)):
        assert cpu_int4_op.kernel_for(m, 960, 576) in ("amx", "tiles"), (m, cpu_int4_op.host_policy())
