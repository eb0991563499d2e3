"""Hugging Face transformers' implementation of a checkpoint's architecture, in float64, as the reference;
and vLLM's log-probs in the same form, to compare with it.

Any built checkpoint (bf16, w4a16's cpu_int4, w4a8's GPTQ) is decoded to full-precision weights by name, so
a 4-bit path is compared with the reference on its own grid: what is left is the engine's arithmetic
(bf16 activations, int8 ones where a kernel uses them), not the 4-bit rounding.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from spark_edge.planning.memory_plan import kv_bytes_for
from spark_edge.planning.model_shape import ModelShape

from spark_reference import _Weights

# a fused tensor and the parts a GPTQ export writes instead (vLLM's loaders stack them again)
# the engine run of engine_log_probs
PROMPT_LEN = 256
NEW_TOKENS = 16
MAX_MODEL_LEN = 512
BATCHED_TOKENS = 128  # the prompt is prefilled in two chunks

FUSED_PARTS = {".qkv_proj.": (".q_proj.", ".k_proj.", ".v_proj."), ".gate_up_proj.": (".gate_proj.", ".up_proj.")}


def _weight(weights: _Weights, name: str) -> torch.Tensor:
    try:
        return weights.get(name)
    except KeyError:
        fused = next((f for f in FUSED_PARTS if f in name), None)
        if fused is None:
            raise
        return torch.cat([weights.get(name.replace(fused, part)) for part in FUSED_PARTS[fused]])


def reference_model(checkpoint: Path) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = json.loads((checkpoint / "config.json").read_text())
    weights = _Weights(checkpoint, config)
    fields = {k: v for k, v in config.items() if k not in ("model_type", "quantization_config", "torch_dtype")}
    hf_config = AutoConfig.for_model(config["model_type"], **fields)
    hf_config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float64).eval()
    head = model.get_output_embeddings()
    tied = head.weight is model.get_input_embeddings().weight
    head_name = next(n for n, m in model.named_modules() if m is head) + ".weight"
    state = {
        name: _weight(weights, name).reshape(param.shape)
        for name, param in model.state_dict().items()
        if not (tied and name == head_name)
    }
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {head_name}, (missing, unexpected)  # a tied head reads the table
    return model


def logprob_matrix(entries: list[dict | None], vocab: int) -> torch.Tensor:
    """vLLM's per-position {token: Logprob} (the whole vocabulary) -> float64 [positions, vocab]."""
    out = torch.full((len(entries), vocab), float("nan"), dtype=torch.float64)
    for i, entry in enumerate(entries):
        for token, lp in entry.items():
            out[i, token] = lp.logprob
    assert not out.isnan().any()
    return out


@torch.no_grad()
def reference_log_probs(checkpoint: Path, tokens: list[int], dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """float64 [len(tokens) - 1, vocab]: row i is the distribution of token i + 1 given tokens[: i + 1], computed
    in `dtype` (bfloat16: what rounding alone costs this model, the yardstick of a bf16 engine)."""
    logits = reference_model(checkpoint).to(dtype)(torch.tensor([tokens])).logits[0, :-1]
    return torch.log_softmax(logits.double(), dim=-1)


def engine_log_probs(
    checkpoint: Path,
    cache_root: Path,
    monkeypatch: pytest.MonkeyPatch,
    quantization: str | None = None,
    chat: list[dict[str, str]] | None = None,
    eager: bool = False,
) -> dict[str, Any]:
    """vLLM's offline engine on `checkpoint`: a seeded PROMPT_LEN-token prompt's log-probs and NEW_TOKENS greedy
    tokens with theirs, over the whole vocabulary; with `chat`, also the prompt tokens vLLM's chat rendering gives
    that conversation (the checkpoint's own template, as /v1/chat/completions renders it) and a short answer.
    `eager` skips vLLM's torch.compile (about 28 s of a tiny model's 50 s start on AMD Zen 4), for checks whose
    subject is the weights, not the compiled graph."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # the engine core in this process: no process spawned that imports torch and vLLM again for each start
    env = {
        "VLLM_CACHE_ROOT": str(cache_root),
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    config = json.loads((checkpoint / "config.json").read_text())
    vocab = int(config["vocab_size"])
    kv = kv_bytes_for(ModelShape.from_config(config), MAX_MODEL_LEN, 1, BATCHED_TOKENS)
    llm = LLM(
        model=str(checkpoint),
        dtype="bfloat16",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=2,
        max_num_batched_tokens=BATCHED_TOKENS,
        kv_cache_memory_bytes=kv,
        max_logprobs=-1,
        enable_prefix_caching=False,
        seed=0,
        quantization=quantization,
        enforce_eager=eager,
    )
    try:
        prompt = torch.randint(0, 256, (PROMPT_LEN,), generator=torch.Generator().manual_seed(5)).tolist()
        params = SamplingParams(
            max_tokens=NEW_TOKENS, temperature=0, detokenize=False, ignore_eos=True, prompt_logprobs=-1, logprobs=-1
        )
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
        chatted = llm.chat(chat, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0] if chat else None
    finally:
        llm.llm_engine.engine_core.shutdown()
    gen = out.outputs[0]
    return {
        "prompt": prompt,
        "tokens": list(gen.token_ids),
        "prompt_lp": logprob_matrix(out.prompt_logprobs[1:], vocab),
        "gen_lp": logprob_matrix(gen.logprobs, vocab),
        "chat_prompt": list(chatted.prompt_token_ids) if chatted else None,
        "chat_answer": list(chatted.outputs[0].token_ids) if chatted else None,
    }


def deviation(run: dict[str, Any], reference: torch.Tensor) -> tuple[tuple[float, float], tuple[float, float]]:
    """(mean, max) |delta log-prob| on the prompt's positions and on the generated tokens'."""
    n = len(run["prompt"])
    prefill = (run["prompt_lp"] - reference[: n - 1]).abs()
    decode = (run["gen_lp"] - reference[n - 1 : n - 1 + len(run["tokens"])]).abs()
    return (float(prefill.mean()), float(prefill.max())), (float(decode.mean()), float(decode.max()))


@dataclass
class Comparison:
    """An engine run of a checkpoint against transformers' float64 reference on the same weights."""

    run: dict[str, Any]  # engine_log_probs'
    reference: torch.Tensor  # reference_log_probs over prompt + generated tokens
    prefill: tuple[float, float]  # (mean, max) |delta log-prob| over the prompt
    decode: tuple[float, float]  # the same over the generated tokens
    rounding: float  # what bf16 rounding alone costs the reference over the prompt (mean)


def compare_with_transformers(
    checkpoint: Path,
    cache_root: Path,
    monkeypatch: pytest.MonkeyPatch,
    quantization: str | None = None,
    chat: list[dict[str, str]] | None = None,
    eager: bool = False,
) -> Comparison:
    run = engine_log_probs(checkpoint, cache_root, monkeypatch, quantization, chat, eager)
    assert len(run["tokens"]) == NEW_TOKENS
    sequence = run["prompt"] + run["tokens"]
    reference = reference_log_probs(checkpoint, sequence)
    prefill, decode = deviation(run, reference)
    n = len(run["prompt"])
    rounding = float((reference_log_probs(checkpoint, sequence, torch.bfloat16) - reference)[: n - 1].abs().mean())
    return Comparison(run, reference, prefill, decode, rounding)
