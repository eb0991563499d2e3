"""The tile GEMMs inside the real model: the default model on w4a16 in vLLM's offline engine, run in this process
(no engine subprocess), so the int4 kernel policy can be switched between calls on one loaded, compiled engine
(and so can runtime fix 13's attention methods: the last test).

Prefill rows go to this host's tile GEMM (AMX tiles, or vdpbf16ps tiles on AVX512-BF16 hosts without AMX); the
previous prefill path dequantized each whole weight to bf16 for oneDNN. Both multiply the same bf16 weights and
differ only in the order of their fp32 sums. How far that moves a 135M model's log-probs was measured on the Xeon
AMX host with the kernels of this repository (teacher-forced over 2044 positions of the license text): AMX tiles
against dequant + oneDNN 0.0000 (both tdpbf16ps, K in the same order: bit-identical), vdpbf16ps tiles against it
0.036 mean / 0.32 max nat, the fp32-activation GEMM 0.041 / 0.48. So greedy continuations of this model tip over
within a few tokens of any such change in rounding, and the comparison is made where rounding cannot hide a
fault: teacher-forced log-probs within that spread, greedy tokens equal up to a step whose candidates were
closer than it. Switching back and forth over prefill and decode steps is also what interleaves the tile
kernels with vLLM's attention (AMX tiles on AMX hosts) and oneDNN: each must find the tile state it expects.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from spark_edge.bench.fidelity import text_chunks
from spark_edge.environment import DISABLED_KERNELS
from spark_edge.formats.tinygemm_layout import detect_layout
from spark_edge.kernels import cpu_int4_op
from spark_edge.runtime import fixes
from spark_edge.weight_paths.builder import build_checkpoint

from engine_lock import engine_lock

pytestmark = pytest.mark.engine

PROMPTS = (  # each alone a prefill of more rows than the tile GEMMs start at (17 on AMX hosts)
    "The capital of France is a large and old city on the river Seine, which many people from all over the "
    "world visit every year because",
    "Write a short story about a small robot who lives in a quiet village by the sea and learns to paint the "
    "boats, in three sentences:",
    "Here is a list of the planets of the solar system, in order from the one closest to the sun to the one "
    "farthest away from it:",
)
NEW_TOKENS = 24
WINDOWS = 2  # of the license text, 511 tokens each: teacher-forced positions
# Twice the widest spread measured between correct kernels (above), for hosts whose oneDNN sums in yet another
# order; a misplaced nibble or scale moves the mean by whole nats
MEAN_NAT = 0.08  # mean |delta log-prob| over the teacher-forced positions
MAX_NAT = 1.0  # worst position; also the widest gap a rounding change may tip a greedy step over


def _configure(policy: cpu_int4_op.KernelPolicy) -> None:
    layout = detect_layout()
    torch.ops.spark_edge.int4_configure(layout.block, layout.halves, *policy)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    if not cpu_int4_op.native_linear_available():
        pytest.skip("the int4 library is not loaded in this process")
    root = tmp_path_factory.mktemp("int4-model")
    checkpoint = build_checkpoint(None, "w4a16", root / "w4a16", {"group_size": 32}).out
    with pytest.MonkeyPatch.context() as mp, engine_lock():
        for key, value in {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CACHE_ROOT": str(root / "vllm-cache"),
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
        }.items():
            mp.setenv(key, value)
        mp.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
        from vllm import LLM

        llm = LLM(
            model=str(checkpoint),
            dtype="bfloat16",
            max_model_len=1024,
            max_num_seqs=4,
            kv_cache_memory_bytes=64 * 2**20,
            enable_prefix_caching=False,
            seed=0,
        )
        try:
            yield llm
        finally:
            _configure(cpu_int4_op.host_policy())
            llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def tile_gemm() -> None:
    """The tile tests' condition: the engine itself also runs where there is none (the last test needs no tiles)."""
    if not cpu_int4_op.host_policy().tiles:
        pytest.skip("no tile GEMM on this host (it prefills on dequantization + oneDNN already): nothing to compare")


@pytest.fixture(scope="module")
def policies(tile_gemm: None) -> dict[str, cpu_int4_op.KernelPolicy]:
    """This host's policy and the previous prefill path's (the tile GEMMs disabled: dequantization + oneDNN)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(DISABLED_KERNELS.name, "int4_gemm_bf16,int4_gemm_amx")
        previous = cpu_int4_op.host_policy()
    host = cpu_int4_op.host_policy()
    assert previous.tiles == 0 and host.tiles != 0
    return {"host": host, "previous": previous}


def _greedy(llm: object) -> list[tuple[list[int], list[dict[int, float]]]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=5)
    outs = llm.generate(list(PROMPTS), params, use_tqdm=False)
    return [
        (list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
        for o in outs
    ]


def _teacher_forced(llm: object, windows: list[list[int]]) -> torch.Tensor:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=w) for w in windows], params, use_tqdm=False)
    return torch.tensor([next(iter(step.values())).logprob for o in outs for step in o.prompt_logprobs[1:]])


def test_teacher_forced_log_probs_within_the_rounding_of_a_summation_order(
    engine: object, policies: dict[str, cpu_int4_op.KernelPolicy], tmp_path: Path
) -> None:
    windows = text_chunks(build_checkpoint(None, "bf16", tmp_path / "bf16").out)[:WINDOWS]
    lp = {}
    for name, policy in policies.items():
        _configure(policy)
        lp[name] = _teacher_forced(engine, windows)
    delta = (lp["host"] - lp["previous"]).abs()
    print(
        f"\n{cpu_int4_op.kernel_for(len(windows[0]), 960, 576)} tiles against dequant + oneDNN over {len(delta)} "
        f"positions: mean |dlogprob| {delta.mean():.4f}, max {delta.max():.3f} nat"
    )
    assert delta.mean() <= MEAN_NAT and delta.max() <= MAX_NAT


def test_greedy_tokens_equal_the_previous_prefill_kernels(
    engine: object, policies: dict[str, cpu_int4_op.KernelPolicy]
) -> None:
    runs = []
    for name in ("host", "previous", "host"):  # every switch crosses prefill and decode steps
        _configure(policies[name])
        runs.append(_greedy(engine))
    for (tokens, logprobs), (old_tokens, _) in zip(runs[0], runs[1]):
        assert tokens[0] == old_tokens[0]
        for step, (a, b) in enumerate(zip(tokens, old_tokens)):
            if a != b:  # from here the contexts differ: a tie within rounding tipped over
                gap = logprobs[step][a] - logprobs[step].get(b, float("-inf"))
                print(f"\ngreedy tokens equal for {step} steps, then {a} against {b}: {gap:.3f} nat apart")
                assert gap <= MAX_NAT, f"step {step}: token {a} vs {b}, {gap:.3f} nat apart"
                break
    # the same kernels after two switches: the same tokens (the tile state and the caches are restored)
    assert [tokens for tokens, _ in runs[2]] == [tokens for tokens, _ in runs[0]]


def test_the_tile_gemm_is_what_prefill_rows_take(tile_gemm: None, engine: object) -> None:
    """Not a vacuous comparison: on this host each prompt alone (and the three prefilled together) has more rows
    than the tile GEMM starts at, on the model's own shapes."""
    tokenizer = engine.get_tokenizer()
    rows = [len(tokenizer.encode(prompt)) for prompt in PROMPTS]
    for m in (*rows, sum(rows)):
        assert cpu_int4_op.kernel_for(m, 960, 576) in ("amx", "tiles"), (m, cpu_int4_op.host_policy())


def test_outputs_equal_with_vllms_own_attention_methods(engine: object) -> None:
    """Runtime fix 13 calls the kernels vLLM's CPU attention methods call, with the same arguments: greedy tokens
    and their log-probs over prefill and decode steps are the same with vLLM's methods back in place."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl as Impl

    lean = {name: getattr(Impl, name) for name in ("forward", "do_kv_cache_update")}
    assert all(fixes._is_ours(method) for method in lean.values()), "fix 13 is not installed in this engine"
    with_fix = _greedy(engine)
    try:
        for name, method in lean.items():
            setattr(Impl, name, method.__wrapped__)
        without = _greedy(engine)
    finally:
        for name, method in lean.items():
            setattr(Impl, name, method)
    assert with_fix == without
