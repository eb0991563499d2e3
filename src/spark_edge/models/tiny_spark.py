"""A small Spark-X2.5-shaped checkpoint with random weights (the real weights are not available here).

Same structure, tensor names, config fields and tokenizer files as a published Spark
checkpoint, so every spark-edge path (build for bf16 / w4a16 / w4a8, plan, serve) treats
it as one. By default it keeps the 1.7B's attention geometry (8 query heads, 2 KV heads of
dim 256, a fused q_k_v_proj of 3072 rows, RoPE theta 1e4 on all 256 dims of sliding
layers and 5e6 on the first 64 dims of full layers, window 512, the 3 sliding + 1 full
layer pattern) and shrinks the rest: 4 layers, hidden 256, intermediate 512, vocab 512.

Weights are drawn so the model is not degenerate: attention scores spread over a few
units (attention is neither uniform nor one-hot), gate scores ~N(0, 1), logits with a
standard deviation of a few units, norm weights around 1.

The tokenizer is byte-level (256 byte tokens, no merges) plus special tokens up to the
vocabulary size, so every id the model can emit decodes.

    spark-edge tiny-spark --out DIR [--layers 4] [--hidden 256] [--sliding-window 512] [--seed 0]
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from spark_edge.models.spark_layout import ARCHITECTURE, FULL, MODEL_TYPE, SLIDING, spark_dims

BYTE_TOKENS = 256
EOS, BOS, PAD = "<|endoftext|>", "<|begin_of_text|>", "<|pad|>"


@dataclass(frozen=True)
class TinySparkShape:
    layers: int = 4
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 256
    intermediate: int = 512
    vocab: int = 512
    sliding_window: int = 512
    sliding_per_full: int = 3  # layer pattern: this many sliding layers, then one full layer
    max_position_embeddings: int = 1048576

    def layer_types(self) -> list[str]:
        period = self.sliding_per_full + 1
        return [FULL if (i + 1) % period == 0 else SLIDING for i in range(self.layers)]


def spark_config(shape: TinySparkShape) -> dict[str, Any]:
    """config.json of a Spark checkpoint, with the published field names."""
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": shape.vocab,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "gelu",
        "max_position_embeddings": shape.max_position_embeddings,
        "rope_parameters": {
            FULL: {"partial_rotary_factor": 0.25, "rope_theta": 5000000},
            SLIDING: {"partial_rotary_factor": 1.0, "rope_theta": 10000},
        },
        "sliding_window": shape.sliding_window,
        "headwise_attn_output_gate": True,
        "gate_attn_act_mode": "sigmoid",
        "layer_types": shape.layer_types(),
        "tie_word_embeddings": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "rms_norm_eps": 1e-06,
        "initializer_range": 0.02,
        "bos_token_id": BYTE_TOKENS + 1,
        "eos_token_id": BYTE_TOKENS,
        "pad_token_id": BYTE_TOKENS + 2,
        "torch_dtype": "bfloat16",
    }
    spark_dims(config)  # refuse a shape the model would refuse
    return config


def random_weights(shape: TinySparkShape, seed: int = 0) -> dict[str, torch.Tensor]:
    """Spark tensor names -> bf16 random tensors (see the module docstring for the scales)."""
    g = torch.Generator().manual_seed(seed)

    def normal(*size: int, std: float) -> torch.Tensor:
        return (torch.randn(*size, generator=g) * std).to(torch.bfloat16)

    def norm_weight() -> torch.Tensor:
        return (1 + 0.1 * torch.randn(shape.hidden, generator=g)).to(torch.bfloat16)

    h, q = shape.hidden, shape.heads * shape.head_dim
    qkv_rows = q + 2 * shape.kv_heads * shape.head_dim
    # table std 0.2: tied logits (unit-RMS state . row) have a std of about 0.2 * sqrt(hidden), 3.2 at 256
    tensors = {"model.embedding.weight": normal(shape.vocab, h, std=0.2)}
    for i in range(shape.layers):
        p = f"model.layers.{i}"
        tensors.update(
            {
                f"{p}.input_layernorm.weight": norm_weight(),
                # q, k entries ~N(0, 1.5^2): scores q.k / sqrt(head_dim) ~N(0, ~5)
                f"{p}.self_attn.q_k_v_proj.weight": normal(qkv_rows, h, std=1.5 / math.sqrt(h)),
                f"{p}.self_attn.g_proj.weight": normal(shape.heads, h, std=1.0 / math.sqrt(h)),
                f"{p}.self_attn.out_proj.weight": normal(h, q, std=1.0 / math.sqrt(q)),
                f"{p}.post_attention_layernorm.weight": norm_weight(),
                f"{p}.mlp.gate_proj.weight": normal(shape.intermediate, h, std=1.0 / math.sqrt(h)),
                f"{p}.mlp.up_proj.weight": normal(shape.intermediate, h, std=1.0 / math.sqrt(h)),
                f"{p}.mlp.down_proj.weight": normal(h, shape.intermediate, std=1.0 / math.sqrt(shape.intermediate)),
            }
        )
    tensors["model.norm.weight"] = norm_weight()
    return tensors


def _byte_vocab() -> dict[str, int]:
    """GPT-2's byte -> printable character map, so a byte-level BPE has one token per byte."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(BYTE_TOKENS):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(BYTE_TOKENS + extra)
            extra += 1
    return {chars[b]: b for b in range(BYTE_TOKENS)}


def write_tokenizer(out: Path, vocab_size: int) -> dict[str, int]:
    """Write the tokenizer files; returns the ids of its "bos", "eos" and "pad" tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab=_byte_vocab(), merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    specials = [EOS, BOS, PAD] + [f"<|reserved_{i}|>" for i in range(vocab_size - BYTE_TOKENS - 3)]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    if tok.get_vocab_size() != vocab_size:
        raise AssertionError(f"tokenizer has {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": BOS,
                "eos_token": EOS,
                "pad_token": PAD,
                "model_max_length": 1048576,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
        + "\n"
    )
    return {"bos": tok.token_to_id(BOS), "eos": tok.token_to_id(EOS), "pad": tok.token_to_id(PAD)}


def make_tiny_spark(out: Path, shape: TinySparkShape = TinySparkShape(), seed: int = 0) -> Path:
    """Write the checkpoint into `out` (created; must be empty or absent). Returns `out`."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out}: exists and is not empty")
    if shape.vocab < BYTE_TOKENS + 3:
        raise ValueError(f"vocab {shape.vocab} is too small for {BYTE_TOKENS} byte tokens and 3 special tokens")
    config = spark_config(shape)
    out.mkdir(parents=True, exist_ok=True)
    save_file(random_weights(shape, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    write_tokenizer(out, shape.vocab)
    return out
