"""Runtime fix 13: vLLM's CPU attention methods without their per-layer Python work (runtime/fixes.py).

The lean methods call the same two kernels with the same arguments, so against vLLM's own methods on the same
inputs the KV cache and the attention output must be bit-identical: decode rows, prefill rows, a mixed batch,
padding rows beyond the batch's tokens, a sliding window, and an fp8 KV cache where this CPU runs one. Whatever
the lean methods do not restate goes to vLLM's. (The same engine's outputs with the fix on and off are compared
in test_int4_kernels_in_the_model.py.)
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch

from spark_edge.environment import DISABLED_KERNELS, kernel_enabled
from spark_edge.runtime import fixes

cpu_attn = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")
from vllm.v1.attention.backend import AttentionType  # noqa: E402

HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 9, 3, 64, 32  # the default model's attention
BLOCKS = 16


def _vllms(method: str) -> Callable[..., Any]:
    """vLLM's own method, whether or not the plugin has patched the class in this process."""
    current = getattr(cpu_attn.CPUAttentionBackendImpl, method)
    return getattr(current, "__wrapped__", current) if fixes._is_ours(current) else current


def _impl(kv_cache_dtype: str = "auto", sliding_window: int | None = None, attn_type: str = AttentionType.DECODER):
    config = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.bfloat16))
    with mock.patch.object(cpu_attn, "get_current_vllm_config", return_value=config):
        return cpu_attn.CPUAttentionBackendImpl(
            num_heads=HEADS,
            head_size=HEAD_SIZE,
            scale=HEAD_SIZE**-0.5,
            num_kv_heads=KV_HEADS,
            alibi_slopes=None,
            sliding_window=sliding_window,
            kv_cache_dtype=kv_cache_dtype,
            attn_type=attn_type,
        )


def _step(query_lens: list[int], context_lens: list[int], padding: int, impl: Any, fp8: bool = False) -> dict:
    """One step's inputs: each sequence has `context` tokens cached and `query` new ones, blocks scattered."""
    gen = torch.Generator().manual_seed(sum(query_lens) * 7 + sum(context_lens))
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    per_seq = [(s + BLOCK - 1) // BLOCK for s in seq_lens]
    order = torch.randperm(BLOCKS, generator=gen).tolist()
    block_table = torch.zeros(len(seq_lens), max(per_seq), dtype=torch.int32)
    taken = 0
    for i, n in enumerate(per_seq):
        block_table[i, :n] = torch.tensor(order[taken : taken + n], dtype=torch.int32)
        taken += n
    slots = [
        int(block_table[i, pos // BLOCK]) * BLOCK + pos % BLOCK
        for i, (c, q) in enumerate(zip(context_lens, query_lens))
        for pos in range(c, c + q)
    ]
    tokens = sum(query_lens)
    rows = tokens + padding
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    isa = cpu_attn._get_attn_isa(torch.bfloat16, BLOCK, HEAD_SIZE, impl.kv_cache_dtype)
    metadata = cpu_attn.CPUAttentionMetadata(
        num_actual_tokens=tokens,
        max_query_len=max(query_lens),
        query_start_loc=query_start_loc,
        max_seq_len=max(seq_lens),
        seq_lens=seq_lens_t,
        block_table=block_table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        scheduler_metadata=cpu_attn.ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(seq_lens),
            num_heads=HEADS,
            num_kv_heads=KV_HEADS,
            head_dim=HEAD_SIZE,
            seq_lens=seq_lens_t,
            dtype=torch.bfloat16,
            query_start_loc=query_start_loc,
            causal=True,
            sliding_window_size=impl.sliding_window,
            isa=isa,
            enable_kv_split=False,
            kv_cache_dtype=impl.kv_cache_dtype,
        ),
    )
    kv_cache = torch.randn(BLOCKS, KV_HEADS, BLOCK, 2 * HEAD_SIZE, generator=gen) * 0.5
    # vLLM keeps an fp8 cache as its bytes
    kv_cache = kv_cache.to(torch.float8_e4m3fn).view(torch.uint8) if fp8 else kv_cache.bfloat16()
    return {
        "layer": SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0),
        "query": torch.randn(rows, HEADS, HEAD_SIZE, generator=gen).bfloat16(),
        "key": torch.randn(rows, KV_HEADS, HEAD_SIZE, generator=gen).bfloat16(),
        "value": torch.randn(rows, KV_HEADS, HEAD_SIZE, generator=gen).bfloat16(),
        "kv_cache": kv_cache,
        "metadata": metadata,
        "output": torch.full((rows, HEADS, HEAD_SIZE), 7.0, dtype=torch.bfloat16),
    }


def _run(update: Callable[..., Any], forward: Callable[..., Any], impl: Any, step: dict) -> tuple:
    kv_cache, output = step["kv_cache"].clone(), step["output"].clone()
    tokens = step["metadata"].num_actual_tokens
    key, value = step["key"][:tokens], step["value"][:tokens]  # what vLLM's update op is given
    update(impl, step["layer"], key, value, kv_cache, step["metadata"].slot_mapping)
    returned = forward(
        impl, step["layer"], step["query"], step["key"], step["value"], kv_cache, step["metadata"], output=output
    )
    assert returned is output
    return kv_cache, output


def _fp8_runs_here() -> bool:
    try:
        cpu_attn._get_attn_isa(torch.bfloat16, BLOCK, HEAD_SIZE, "fp8")
        return fixes.attention_kernels() is not None and torch.cpu._is_avx512_supported()
    except Exception:
        return False


CASES = {
    "decode": ([1, 1, 1], [4, 36, 70], 0),
    "prefill": ([37], [0], 0),
    "mixed": ([7, 1, 20], [0, 45, 12], 0),
    "padded": ([1, 1], [9, 63], 3),
}


@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("case", list(CASES))
def test_lean_methods_are_bit_identical_to_vllms(case: str, window: int | None) -> None:
    kernels = fixes.attention_kernels()
    assert kernels is not None, "vLLM's CPU attention kernels no longer have the schemas fix 13 was written for"
    reshape_and_cache, attention = kernels
    update, forward = _vllms("do_kv_cache_update"), _vllms("forward")
    lean_update = fixes.lean_kv_cache_update(update, reshape_and_cache)
    lean_forward = fixes.lean_attention_forward(forward, attention)
    impl = _impl(sliding_window=window)
    step = _step(*CASES[case], impl)
    theirs = _run(update, forward, impl, step)
    ours = _run(lean_update, lean_forward, impl, step)
    assert torch.equal(ours[0], theirs[0]), "KV cache"
    assert torch.equal(ours[1], theirs[1]), "attention output"
    tokens = step["metadata"].num_actual_tokens
    assert not torch.equal(theirs[1][:tokens], step["output"][:tokens]), "the kernels wrote nothing"
    assert torch.equal(ours[1][tokens:], step["output"][tokens:]), "padding rows are left alone"


@pytest.mark.skipif(not _fp8_runs_here(), reason="vLLM's fp8 KV cache needs AVX-512 or AMX")
def test_lean_methods_are_bit_identical_with_an_fp8_kv_cache() -> None:
    reshape_and_cache, attention = fixes.attention_kernels()
    update, forward = _vllms("do_kv_cache_update"), _vllms("forward")
    impl = _impl(kv_cache_dtype="fp8")
    step = _step(*CASES["mixed"], impl, fp8=True)
    theirs = _run(update, forward, impl, step)
    ours = _run(
        fixes.lean_kv_cache_update(update, reshape_and_cache),
        fixes.lean_attention_forward(forward, attention),
        impl,
        step,
    )
    assert torch.equal(ours[0], theirs[0])
    assert torch.equal(ours[1], theirs[1])


def test_views_are_made_again_for_another_kv_cache() -> None:
    impl = SimpleNamespace()
    first = torch.zeros(2, KV_HEADS, BLOCK, 2 * HEAD_SIZE)
    key_cache, value_cache = fixes.kv_cache_views(impl, first)
    assert fixes.kv_cache_views(impl, first)[0] is key_cache  # kept
    first.view(2, KV_HEADS, 2 * BLOCK, HEAD_SIZE)[0, 1, BLOCK + 3, 5] = 2.0  # a block's values follow its keys
    assert value_cache[0, 1, 3, 5] == 2.0 and key_cache.shape == (2, KV_HEADS, BLOCK, HEAD_SIZE)
    second = torch.zeros(4, KV_HEADS, BLOCK, 2 * HEAD_SIZE)
    assert fixes.kv_cache_views(impl, second)[0].shape[0] == 4


def _recording(calls: list[str]) -> Callable[..., Any]:
    def original(*args: Any, **kwargs: Any) -> str:
        calls.append("vllm")
        return "vllm's"

    return original


@pytest.mark.parametrize("what", ["encoder-only", "encoder", "warm-up", "output scale", "fp16 sinks"])
def test_what_the_lean_forward_does_not_restate_goes_to_vllms(what: str) -> None:
    calls: list[str] = []
    forward = fixes.lean_attention_forward(_recording(calls), attention=None)  # would fail if reached
    impl = SimpleNamespace(attn_type=AttentionType.DECODER, sinks=None)
    metadata, scale = object(), None
    if what == "encoder-only":
        impl.attn_type = AttentionType.ENCODER_ONLY
    elif what == "encoder":
        impl.attn_type = AttentionType.ENCODER
    elif what == "warm-up":
        metadata = None
    elif what == "output scale":
        scale = torch.ones(1)
    else:
        impl.sinks = torch.zeros(HEADS, dtype=torch.float16)
    assert forward(impl, None, None, None, None, None, metadata, None, output_scale=scale) == "vllm's"
    assert calls == ["vllm"]


def test_encoder_kv_updates_go_to_vllms() -> None:
    calls: list[str] = []
    update = fixes.lean_kv_cache_update(_recording(calls), reshape_and_cache=None)
    update(SimpleNamespace(attn_type=AttentionType.ENCODER_ONLY), None, None, None, None, None)
    assert calls == ["vllm"]


def _fake_module() -> ModuleType:
    module = ModuleType("fake_cpu_attn")

    class Impl:
        def forward(self) -> None: ...

        def do_kv_cache_update(self) -> None: ...

    module.CPUAttentionBackendImpl = Impl
    return module


def test_the_patch_installs_where_it_was_written_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DISABLED_KERNELS.name, raising=False)
    module = _fake_module()
    fixes._patch_cpu_attention_step(module)
    assert fixes._is_ours(module.CPUAttentionBackendImpl.forward)
    assert fixes._is_ours(module.CPUAttentionBackendImpl.do_kv_cache_update)
    patched = module.CPUAttentionBackendImpl.forward
    fixes._patch_cpu_attention_step(module)
    assert module.CPUAttentionBackendImpl.forward is patched  # idempotent


@pytest.mark.skipif(not kernel_enabled("attention_step"), reason="turned off in this environment")
def test_vllms_class_is_patched_in_this_process() -> None:
    fixes.apply_runtime_fixes()
    assert fixes._is_ours(cpu_attn.CPUAttentionBackendImpl.forward)
    assert fixes._is_ours(cpu_attn.CPUAttentionBackendImpl.do_kv_cache_update)


@pytest.mark.parametrize("off", ["disabled by name", "another vLLM", "another kernel schema"])
def test_the_patch_stays_off(off: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if off == "disabled by name":
        monkeypatch.setenv(DISABLED_KERNELS.name, "attention_step")
    elif off == "another vLLM":
        monkeypatch.setattr(fixes, "ATTENTION_STEP_VLLM", "0.33.")
    else:
        schemas = dict(fixes._ATTENTION_SCHEMAS, cpu_attention_with_kv_cache="query key_cache value_cache output")
        monkeypatch.setattr(fixes, "_ATTENTION_SCHEMAS", schemas)
    module = _fake_module()
    fixes._patch_cpu_attention_step(module)
    assert not fixes._is_ours(module.CPUAttentionBackendImpl.forward)
    assert not fixes._is_ours(module.CPUAttentionBackendImpl.do_kv_cache_update)
