"""What a Spark-X2.5 checkpoint looks like: config fields, tensor names, layer kinds.

Plain Python (no torch, no vLLM), so the checkpoint writers, the memory plan and the
tiny-checkpoint maker can use it without loading either.

Checkpoint tensor names (HF side), per layer i:

    model.embedding.weight                         [vocab, hidden]  (tied to the head)
    model.layers.i.input_layernorm.weight          [hidden]
    model.layers.i.self_attn.q_k_v_proj.weight     [(heads + 2 kv_heads) * head_dim, hidden]  fused q|k|v
    model.layers.i.self_attn.g_proj.weight         [heads, hidden]  head-wise output gate
    model.layers.i.self_attn.out_proj.weight       [hidden, heads * head_dim]
    model.layers.i.post_attention_layernorm.weight [hidden]
    model.layers.i.mlp.{gate,up}_proj.weight       [intermediate, hidden]  GEGLU, exact gelu
    model.layers.i.mlp.down_proj.weight            [hidden, intermediate]
    model.norm.weight                              [hidden]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spark_edge.models.declared_layout import DeclaredLayout

ARCHITECTURE = "Spark2_5ForCausalLM"
MODEL_TYPE = "spark2_5"
SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)
GATE_ACTS = ("sigmoid", "silu")

EMBEDDING = "model.embedding.weight"
QKV = ".self_attn.q_k_v_proj."  # fused q|k|v, split on load (cpu_int4, bf16) or at export (GPTQ)
OUT_PROJ = ".self_attn.out_proj."
HEAD_GATE = ".self_attn.g_proj.weight"  # full precision on every weight path (0.001% of the weights)
MLP_PROJ = (".mlp.gate_proj.", ".mlp.up_proj.", ".mlp.down_proj.")
# every Linear weight of a decoder layer (what the 4-bit paths quantize)
LINEAR_WEIGHT_SUFFIXES = (
    ".self_attn.q_k_v_proj.weight",
    ".self_attn.out_proj.weight",
    ".mlp.gate_proj.weight",
    ".mlp.up_proj.weight",
    ".mlp.down_proj.weight",
)


LAYOUT = DeclaredLayout(
    ARCHITECTURE,
    MODEL_TYPE,
    EMBEDDING,
    "lm_head.weight",
    LINEAR_WEIGHT_SUFFIXES,
    full_precision_suffixes=(HEAD_GATE,),
    fused_qkv=QKV,
)


def is_spark(config: dict[str, Any]) -> bool:
    return LAYOUT.matches(config)


@dataclass(frozen=True)
class SparkDims:
    """The numbers of a Spark config the model, the writers and the plan need, checked for consistency."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    layer_types: tuple[str, ...]
    sliding_window: int
    rope: dict[str, dict[str, float]]  # layer type -> {"rope_theta", "partial_rotary_factor"}
    gate_act: str
    tied: bool

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def qkv_rows(self) -> tuple[int, int, int]:
        """Rows of q, k and v in the fused q_k_v_proj, in that order."""
        return self.q_size, self.kv_size, self.kv_size

    def rotary_dim(self, layer_type: str) -> int:
        return int(self.head_dim * self.rope[layer_type]["partial_rotary_factor"])


def _rope(config: dict[str, Any], types: set[str]) -> dict[str, dict[str, float]]:
    params = config.get("rope_parameters")
    if not isinstance(params, dict) or not types <= set(params):
        raise ValueError(
            f"Spark config: rope_parameters must hold an entry per layer type {sorted(types)}, got {params!r}"
        )
    rope: dict[str, dict[str, float]] = {}
    for kind in types:
        entry = params[kind] or {}
        rope_type = entry.get("rope_type", entry.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"Spark config: {kind} rope_type {rope_type!r} is not supported (only 'default')")
        factor = float(entry.get("partial_rotary_factor", 1.0))
        if not 0.0 < factor <= 1.0:
            raise ValueError(f"Spark config: {kind} partial_rotary_factor {factor} is not in (0, 1]")
        rope[kind] = {"rope_theta": float(entry.get("rope_theta", 10000.0)), "partial_rotary_factor": factor}
    return rope


def spark_dims(config: dict[str, Any]) -> SparkDims:
    """Read and check a Spark config.json dict; ValueError names the first inconsistency."""
    try:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        dims = dict(
            hidden=hidden,
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate=int(config["intermediate_size"]),
            vocab=int(config["vocab_size"]),
        )
        layers = int(config["num_hidden_layers"])
    except KeyError as exc:
        raise ValueError(f"Spark config: missing {exc.args[0]!r}") from None
    types = tuple(config.get("layer_types") or [FULL] * layers)
    if len(types) != layers:
        raise ValueError(f"Spark config: {len(types)} layer_types for {layers} layers")
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"Spark config: unknown layer types {unknown} (known: {list(LAYER_TYPES)})")
    if dims["heads"] % dims["kv_heads"]:
        raise ValueError(f"Spark config: {dims['heads']} heads do not group over {dims['kv_heads']} KV heads")
    window = config.get("sliding_window")
    if SLIDING in types and not (isinstance(window, int) and window > 0):
        raise ValueError(f"Spark config: sliding layers need a positive sliding_window, got {window!r}")
    if config.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"Spark config: hidden_act must be 'gelu' (exact GEGLU), got {config['hidden_act']!r}")
    if not config.get("headwise_attn_output_gate", True):
        raise ValueError("Spark config: headwise_attn_output_gate false is not a Spark-X2.5 model")
    gate_act = config.get("gate_attn_act_mode", "sigmoid")
    if gate_act not in GATE_ACTS:
        raise ValueError(f"Spark config: gate_attn_act_mode {gate_act!r} (known: {list(GATE_ACTS)})")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError("Spark config: attention_bias / mlp_bias are not supported")
    return SparkDims(
        **dims,
        layer_types=types,
        sliding_window=int(window or 0),
        rope=_rope(config, set(types)),
        gate_act=gate_act,
        tied=bool(config.get("tie_word_embeddings", False)),
    )


def split_qkv_name(name: str, part: str) -> str:
    """model.layers.i.self_attn.q_k_v_proj.X -> model.layers.i.self_attn.{q,k,v}_proj.X"""
    if QKV not in name or part not in ("q", "k", "v"):
        raise ValueError(f"not a fused q_k_v_proj tensor or part: {name!r} {part!r}")
    return name.replace(QKV, f".self_attn.{part}_proj.")
