"""Spark-X2.5 (architecture "Spark2_5ForCausalLM") as an out-of-tree vLLM model.

What sets it apart from a Llama decoder (see spark_layout for the checkpoint names):
- hybrid attention: `layer_types` mixes sliding-window layers (window `sliding_window`,
  512 on the 1.7B) with full-attention layers; vLLM gets the window per layer, so its
  KV cache manager frees what falls out of a sliding layer's window;
- RoPE per layer type from the nested `rope_parameters` (neox style; the full layers
  rotate only the first `partial_rotary_factor` of each head);
- a head-wise output gate: `g_proj` [heads, hidden] reads the same post-norm input as
  QKV and scales each head's attention output by sigmoid(score) before `out_proj`,
  run as the opaque custom op of head_gate;
- GEGLU MLP with exact gelu; tied embeddings.

Loading: the fused `q_k_v_proj` is split into q/k/v on the fly (bf16 and cpu_int4
tensors keep N on dim 0, so a row split is exact for both); GPTQ checkpoints come split
already (N is on dim 1 there). `model.embedding.` is renamed to `model.embed_tokens.`;
`g_proj.weight` is a plain parameter (never quantized, never a vLLM linear).

RoPE tables are built for the served context only: vLLM sizes a rotary table by the
`max_position` it is given, and the configured 1,048,576 positions cost 640 MB of cos/sin
on the 1.7B (512 MB for the sliding layers' 256-wide table, 128 MB for the full layers'
64-wide one) where a 2048-token server needs 1.25 MB. Positions never reach
max_model_len, so the cap changes no result.
"""

# No `from __future__ import annotations` here: vLLM's @support_torch_compile reads the forward
# signature's annotations (real types, not strings) to find the dynamic token dimension.
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import CacheConfig, VllmConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.activation import get_act_and_mul_fn
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper, extract_layer_index, maybe_prefix
from vllm.model_executor.utils import set_weight_attrs
from vllm.sequence import IntermediateTensors

from spark_edge.models.head_gate import register_op
from spark_edge.models.spark_layout import QKV, SLIDING, SparkDims, spark_dims, split_qkv_name

register_op()

# Fused q_k_v_proj tensors that keep N (output rows) on dim 0 and so split by rows on load:
# bf16 weights and cpu_int4's packed codes, scales and zeros.
ROW_SPLIT_SUFFIXES = ("weight", "weight_packed", "weight_scale", "weight_zero")


def rope_max_position(max_position_embeddings: int, max_model_len: int | None) -> int:
    """Rows of the RoPE cos/sin table: the served context, never more than the model was built for."""
    if not max_model_len:
        return max_position_embeddings
    return min(max_position_embeddings, int(max_model_len))


def _dims(config: Any) -> SparkDims:
    return spark_dims(config.to_dict())


class SparkMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [intermediate] * 2, bias=False, quant_config=quant_config, prefix=f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(
            intermediate, hidden, bias=False, quant_config=quant_config, prefix=f"{prefix}.down_proj"
        )
        self.act_fn = get_act_and_mul_fn("gelu")  # exact (erf) gelu(gate) * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)
        out, _ = self.down_proj(self.act_fn(gate_up))
        return out


class HeadGate(nn.Module):
    """`g_proj`: one gate score per query head of this rank; a plain parameter, never quantized."""

    def __init__(self, heads: int, hidden: int, use_silu: bool) -> None:
        super().__init__()
        self.heads = heads  # on this tensor-parallel rank
        self.use_silu = use_silu
        self.weight = nn.Parameter(torch.empty(heads, hidden, dtype=torch.get_default_dtype()), requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": self._load})

    def _load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        rows = loaded.narrow(0, get_tensor_model_parallel_rank() * self.heads, self.heads)
        if rows.shape != param.shape:
            raise ValueError(f"g_proj: checkpoint rows {tuple(rows.shape)} do not fit {tuple(param.shape)}")
        param.data.copy_(rows)

    def forward(self, attn: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.spark_edge.spark_head_gate(attn, x, self.weight, self.use_silu)


class SparkAttention(nn.Module):
    def __init__(
        self,
        dims: SparkDims,
        max_position: int,
        cache_config: CacheConfig | None,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        if dims.heads % tp or (dims.kv_heads % tp and tp % dims.kv_heads):
            raise ValueError(f"Spark: {dims.heads} heads / {dims.kv_heads} KV heads do not split over TP={tp}")
        self.heads = dims.heads // tp
        self.kv_heads = max(1, dims.kv_heads // tp)
        self.head_dim = dims.head_dim
        self.q_size = self.heads * dims.head_dim
        self.kv_size = self.kv_heads * dims.head_dim
        self.qkv_proj = QKVParallelLinear(
            dims.hidden,
            dims.head_dim,
            dims.heads,
            dims.kv_heads,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.out_proj = RowParallelLinear(
            dims.q_size, dims.hidden, bias=False, quant_config=quant_config, prefix=f"{prefix}.out_proj"
        )
        self.g_proj = HeadGate(self.heads, dims.hidden, use_silu=dims.gate_act == "silu")

        layer_type = dims.layer_types[extract_layer_index(prefix)]
        self.layer_type = layer_type
        rope = dims.rope[layer_type]
        self.rotary_emb = get_rope(
            dims.head_dim,
            max_position=max_position,
            is_neox_style=True,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": rope["rope_theta"],
                "partial_rotary_factor": rope["partial_rotary_factor"],
            },
        )
        self.attn = Attention(
            self.heads,
            dims.head_dim,
            dims.head_dim**-0.5,
            num_kv_heads=self.kv_heads,
            cache_config=cache_config,
            quant_config=quant_config,
            per_layer_sliding_window=dims.sliding_window if layer_type == SLIDING else None,
            prefix=f"{prefix}.attn",
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        attn = self.attn(q, k, v)
        out, _ = self.out_proj(self.g_proj(attn, x))
        return out


class SparkDecoderLayer(nn.Module):
    def __init__(
        self,
        dims: SparkDims,
        eps: float,
        max_position: int,
        cache_config: CacheConfig | None,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        self.self_attn = SparkAttention(dims, max_position, cache_config, quant_config, f"{prefix}.self_attn")
        self.mlp = SparkMLP(dims.hidden, dims.intermediate, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(dims.hidden, eps=eps)
        self.post_attention_layernorm = RMSNorm(dims.hidden, eps=eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


@support_torch_compile
class SparkModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        quant_config = vllm_config.quant_config
        dims = _dims(config)
        max_position = rope_max_position(config.max_position_embeddings, vllm_config.model_config.max_model_len)
        self.embed_tokens = VocabParallelEmbedding(
            dims.vocab, dims.hidden, quant_config=quant_config, prefix=f"{prefix}.embed_tokens"
        )
        self.layers = nn.ModuleList(
            SparkDecoderLayer(
                dims,
                config.rms_norm_eps,
                max_position,
                vllm_config.cache_config,
                quant_config,
                prefix=f"{prefix}.layers.{i}",
            )
            for i in range(len(dims.layer_types))
        )
        self.norm = RMSNorm(dims.hidden, eps=config.rms_norm_eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


def split_fused_qkv(weights: Iterable[tuple[str, torch.Tensor]], dims: SparkDims) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint q_k_v_proj tensors -> q_proj / k_proj / v_proj tensors (rows split in that order)."""
    rows = dims.qkv_rows
    for name, tensor in weights:
        if QKV not in name:
            yield name, tensor
            continue
        suffix = name.rsplit(".", 1)[1]
        if suffix not in ROW_SPLIT_SUFFIXES:
            raise ValueError(
                f"{name}: a fused q_k_v_proj '{suffix}' tensor cannot be split on load (its N is not "
                "on dim 0); export q/k/v separately (spark-edge build --weight-path w4a8 does)"
            )
        if tensor.shape[0] != sum(rows):
            raise ValueError(f"{name}: {tensor.shape[0]} rows, the config implies {sum(rows)} (q|k|v = {rows})")
        for part, piece in zip("qkv", tensor.split(list(rows), dim=0)):
            yield split_qkv_name(name, part), piece


class SparkForCausalLM(nn.Module):
    # the layers vLLM fuses, for quantization configs that name the unfused ones
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_prefix={"model.embedding.": "model.embed_tokens."},
        orig_to_new_stacked={
            ".q_proj.": (".qkv_proj.", "q"),
            ".k_proj.": (".qkv_proj.", "k"),
            ".v_proj.": (".qkv_proj.", "v"),
            ".gate_proj.": (".gate_up_proj.", 0),
            ".up_proj.": (".gate_up_proj.", 1),
        },
    )

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.dims = _dims(config)
        self.quant_config = vllm_config.quant_config
        self.model = SparkModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(
            self.dims.vocab, self.dims.hidden, quant_config=self.quant_config, prefix=maybe_prefix(prefix, "lm_head")
        )
        if self.dims.tied:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(self.dims.vocab)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loader = AutoWeightsLoader(self)
        return loader.load_weights(split_fused_qkv(weights, self.dims), mapper=self.hf_to_vllm_mapper)
