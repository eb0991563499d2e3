"""Random-weight checkpoints with real models' geometries, for planning and benchmarking before the weights exist.

`spark-edge synth --like NAME --out DIR` writes a Hugging Face folder shaped like a published model (its
config's geometry and architecture fields; tensor names and shapes as the architecture's transformers model
holds them) with random bf16 weights and the default model's tokenizer.
Speed and memory depend on the geometry only, so a box can be sized and measured for a 1-2 B model
without its weights; its text is noise. The folder is written tensor by tensor (one tensor in memory at a
time), deterministic from the seed, and config.json carries `spark_edge_synthetic` so every later step
(build, plan, serve) can say it serves random weights.

Weights are drawn so activations keep their scale through the layers (no NaN or overflow in bf16) and a
small model's logits spread over a few units: every matrix ~N(0, 1/width) (the token table too, so a tied
head's logits have unit scale), biases ~N(0, 0.02), norms ~1 (Gemma's 1 + w too: w ~0).

`--tiny` keeps a preset's architecture fields and attention geometry (heads, KV heads, head width) and
shrinks the rest (hidden ~256, 4 layers or one period of a layer pattern, MLP 512, a 512-token byte-level
tokenizer, windows of 64 tokens):
a model small enough to check against a reference implementation, with the family's real structure.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from spark_edge.checkpoints.safetensors_stream import RowChunks, TensorSpec, write_safetensors
from spark_edge.checkpoints.synthetic_marker import SYNTHETIC_KEY

BLOCK_ELEMENTS = 4 << 20  # 16 MiB of fp32 drawn at a time


@dataclass(frozen=True)
class Preset:
    architecture: str
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool = False
    head_dim: int | None = None
    extra: tuple[tuple[str, Any], ...] = ()  # further config.json fields (RoPE, context)
    norm_offset: float = 0.0  # the model scales by offset + w (Gemma: 1 + w): norms are drawn so the sum is ~1

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads


def _gemma3_layer_types(layers: int, period: int = 6) -> list[str]:
    """Gemma 3: five sliding-window layers, then one global one."""
    return ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(layers)]


# Geometries from each model's published config.json (hidden, layers, heads, KV heads, MLP, vocab, tying), and the
# fields that make the architecture what it is (biases, norms, windows, RoPE).
PRESETS: dict[str, Preset] = {
    "smollm2-1.7b": Preset(
        "LlamaForCausalLM",
        "llama",
        2048,
        24,
        32,
        32,
        8192,
        49152,
        tied=True,
        extra=(("rope_theta", 130000.0), ("max_position_embeddings", 8192)),
    ),
    "llama-3.2-1b": Preset(
        "LlamaForCausalLM",
        "llama",
        2048,
        16,
        32,
        8,
        8192,
        128256,
        tied=True,
        head_dim=64,
        extra=(
            ("rope_theta", 500000.0),
            ("max_position_embeddings", 131072),
            (
                "rope_scaling",
                {
                    "rope_type": "llama3",
                    "factor": 32.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                },
            ),
        ),
    ),
    "qwen2.5-1.5b": Preset(
        "Qwen2ForCausalLM",
        "qwen2",
        1536,
        28,
        12,
        2,
        8960,
        151936,
        tied=True,
        qkv_bias=True,
        extra=(("rope_theta", 1000000.0), ("max_position_embeddings", 32768), ("use_sliding_window", False)),
    ),
    # q and k RMS-normed per head, no biases
    "qwen3-1.7b": Preset(
        "Qwen3ForCausalLM",
        "qwen3",
        2048,
        28,
        16,
        8,
        6144,
        151936,
        tied=True,
        head_dim=128,
        extra=(("rope_theta", 1000000.0), ("max_position_embeddings", 40960), ("use_sliding_window", False)),
    ),
    # q/k norms, four norms a layer, embedding scaled by sqrt(hidden), 512-token windows in 5 of 6 layers
    "gemma-3-1b": Preset(
        "Gemma3ForCausalLM",
        "gemma3_text",
        1152,
        26,
        4,
        1,
        6912,
        262144,
        tied=True,
        head_dim=256,
        norm_offset=1.0,
        extra=(
            ("hidden_act", "gelu_pytorch_tanh"),
            ("hidden_activation", "gelu_pytorch_tanh"),
            ("query_pre_attn_scalar", 256),
            ("sliding_window", 512),
            ("layer_types", _gemma3_layer_types(26)),
            ("rope_theta", 1000000.0),
            ("rope_local_base_freq", 10000.0),
            ("max_position_embeddings", 32768),
            ("final_logit_softcapping", None),
            ("attn_logit_softcapping", None),
        ),
    ),
    # Phi-3-mini-4k: q/k/v and gate/up stored fused (qkv_proj, gate_up_proj), untied head
    "phi-3-mini": Preset(
        "Phi3ForCausalLM",
        "phi3",
        3072,
        32,
        32,
        32,
        8192,
        32064,
        tied=False,
        extra=(
            ("rope_theta", 10000.0),
            ("max_position_embeddings", 4096),
            ("original_max_position_embeddings", 4096),
            ("sliding_window", 2047),
            ("rms_norm_eps", 1e-5),
        ),
    ),
    "spark-x2.5-1.7b": Preset("Spark2_5ForCausalLM", "spark2_5", 2048, 28, 8, 2, 6656, 131072, tied=True, head_dim=256),
}
TINY = {"hidden": 256, "layers": 4, "intermediate": 512, "vocab": 512}  # the attention geometry stays published
TINY_WINDOW = 64  # a tiny model's sliding window: test prompts cross it


def tiny(preset: Preset) -> Preset:
    """The preset with hidden, layers, MLP and vocabulary shrunk and its architecture fields kept. A config that
    states its head width keeps its heads; one that leaves it to hidden / heads (vLLM's Qwen2 derives it so)
    keeps the head width and as many heads as the tiny width holds, KV heads in proportion."""
    extra = dict(preset.extra)
    shape = dict(TINY)
    if "layer_types" in extra:  # the published pattern's first period (Gemma 3: five sliding layers, one full)
        types = list(extra["layer_types"])
        extra["layer_types"] = types[: types.index("full_attention") + 1]
        extra["sliding_window"] = TINY_WINDOW
        shape["layers"] = len(extra["layer_types"])
    if preset.head_dim is None:
        heads = max(1, TINY["hidden"] // preset.dim)
        shape.update(hidden=heads * preset.dim, heads=heads, kv_heads=max(1, heads * preset.kv_heads // preset.heads))
    return dataclasses.replace(preset, extra=tuple(extra.items()), **shape)


def hf_config(name: str, preset: Preset, seed: int, bos: int, eos: int) -> dict[str, Any]:
    if preset.model_type == "spark2_5":
        from spark_edge.models.tiny_spark import TinySparkShape, spark_config

        config = spark_config(
            TinySparkShape(
                layers=preset.layers,
                hidden=preset.hidden,
                heads=preset.heads,
                kv_heads=preset.kv_heads,
                head_dim=preset.dim,
                intermediate=preset.intermediate,
                vocab=preset.vocab,
            )
        )
    else:
        config = {
            "architectures": [preset.architecture],
            "model_type": preset.model_type,
            "hidden_size": preset.hidden,
            "num_hidden_layers": preset.layers,
            "num_attention_heads": preset.heads,
            "num_key_value_heads": preset.kv_heads,
            "head_dim": preset.dim,
            "intermediate_size": preset.intermediate,
            "vocab_size": preset.vocab,
            "tie_word_embeddings": preset.tied,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "attention_bias": preset.qkv_bias,
            "mlp_bias": False,
            "torch_dtype": "bfloat16",
            **dict(preset.extra),
        }
    config.update(bos_token_id=bos, eos_token_id=eos)
    config.setdefault("pad_token_id", eos)  # transformers' own default (Phi-3's 32000) may lie outside a tiny vocab
    config[SYNTHETIC_KEY] = {"like": name, "seed": seed}
    return config


def tensor_specs(preset: Preset) -> list[TensorSpec]:
    """Every tensor of the checkpoint, named and shaped as the architecture's own model holds them."""
    if preset.model_type != "spark2_5":
        from spark_edge.checkpoints.architecture import tensor_shapes

        config = hf_config("", preset, 0, 0, 0)
        return [TensorSpec(name, torch.bfloat16, shape) for name, shape in tensor_shapes(config)]
    h, q, kv, i = preset.hidden, preset.heads * preset.dim, preset.kv_heads * preset.dim, preset.intermediate
    layer = [
        ("input_layernorm.weight", (h,)),
        ("self_attn.q_k_v_proj.weight", (q + 2 * kv, h)),
        ("self_attn.g_proj.weight", (preset.heads, h)),
        ("self_attn.out_proj.weight", (h, q)),
        ("post_attention_layernorm.weight", (h,)),
        ("mlp.gate_proj.weight", (i, h)),
        ("mlp.up_proj.weight", (i, h)),
        ("mlp.down_proj.weight", (h, i)),
    ]
    specs = [TensorSpec("model.embedding.weight", torch.bfloat16, (preset.vocab, h))]
    for n in range(preset.layers):
        specs += [TensorSpec(f"model.layers.{n}.{suffix}", torch.bfloat16, shape) for suffix, shape in layer]
    specs.append(TensorSpec("model.norm.weight", torch.bfloat16, (h,)))
    return specs


def _seed_for(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")


def _std(spec: TensorSpec) -> float:
    if spec.name.endswith(".bias"):
        return 0.02
    return 1.0 / math.sqrt(spec.shape[-1])


def random_rows(spec: TensorSpec, seed: int, norm_offset: float = 0.0) -> Iterator[torch.Tensor]:
    """One tensor as blocks of at most BLOCK_ELEMENTS values, drawn from a generator seeded by (seed, name): the
    same whatever order tensors are made in. The block size is part of the draw (changing it changes the
    weights). One fp32 buffer is drawn into and scaled in place for every block, so the writer's memory is that
    buffer and one bf16 block, whatever the allocator does with freed blocks."""
    g = torch.Generator().manual_seed(_seed_for(seed, spec.name))
    if spec.name.endswith("norm.weight"):
        yield (1 - norm_offset + 0.1 * torch.randn(spec.shape, generator=g)).to(spec.dtype)
        return
    width = spec.shape[-1]
    total = math.prod(spec.shape[:-1])
    block_rows = max(1, BLOCK_ELEMENTS // width)
    buffer = torch.empty(min(block_rows, total), width)
    for start in range(0, total, block_rows):
        drawn = buffer[: min(block_rows, total - start)]
        torch.randn(drawn.shape, generator=g, out=drawn)
        block = drawn.mul_(_std(spec)).to(spec.dtype)
        yield block.view(-1, *spec.shape[1:]) if len(spec.shape) > 1 else block.view(-1)


def random_tensor(spec: TensorSpec, seed: int) -> torch.Tensor:
    """The whole tensor random_rows writes block by block (for tests and small tensors)."""
    return torch.cat(list(random_rows(spec, seed))).view(spec.shape)


def _tensors(specs: list[TensorSpec], seed: int, norm_offset: float = 0.0) -> Iterator[tuple[str, RowChunks]]:
    for spec in specs:
        yield spec.name, RowChunks(spec.dtype, spec.shape, random_rows(spec, seed, norm_offset))


def write_synthetic(name: str, out: Path, seed: int = 0, small: bool = False) -> Path:
    """Write the checkpoint into `out` (absent or empty); `small`: the preset's tiny() version with a byte-level
    tokenizer. Raises KeyError for an unknown preset."""
    preset = PRESETS[name]
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out}: exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    if small:
        return _write_tiny(name, out, seed)
    from spark_edge.checkpoints.default_model import default_gguf
    from spark_edge.checkpoints.gguf_source import GGUFSource

    # The default model lends its tokenizer and chat template. Its GGUF reader holds the vocabulary as ~0.2 GiB
    # of Python objects, and transformers' conversion reads it again: the source is dropped before the weights,
    # and the tokenizer converted after them (peak 658 MiB measured on an AMD EPYC host, was 817).
    default = GGUFSource(default_gguf())
    source_config, save_tokenizer = default.hf_config(), default.tokenizer_saver()
    del default
    config = hf_config(name, preset, seed, source_config.get("bos_token_id", 1), source_config.get("eos_token_id", 2))
    specs = tensor_specs(preset)
    write_safetensors(out, specs, _tensors(specs, seed, preset.norm_offset), max_shard_bytes=2 << 30)
    save_tokenizer(out)
    return _write_config(out, config)


def _write_tiny(name: str, out: Path, seed: int) -> Path:
    from spark_edge.models import tiny_spark

    preset = tiny(PRESETS[name])
    ids = tiny_spark.write_tokenizer(out, preset.vocab)
    config = hf_config(f"{name} (tiny)", preset, seed, ids["bos"], ids["eos"])
    config["pad_token_id"] = ids["pad"]
    specs = tensor_specs(preset)
    write_safetensors(out, specs, _tensors(specs, seed, preset.norm_offset))
    return _write_config(out, config)


def _write_config(out: Path, config: dict[str, Any]) -> Path:
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out
