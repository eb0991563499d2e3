"""The Hugging Face config class of Spark-X2.5 (model_type "spark2_5"), so it loads without remote code.

The published checkpoints ship `configuration_spark.py` behind `auto_map` and ask for
`trust_remote_code`. Registering this class with transformers' AutoConfig (the plugin does,
in every vLLM process) lets vLLM, its tokenizer loader and our tools read config.json
without executing files that came with the weights. Field names and meanings are the
published config's; defaults are Spark-X2.5-1.7B's.
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import AutoConfig
from transformers.configuration_utils import PreTrainedConfig

from spark_edge.models.spark_layout import FULL, MODEL_TYPE, SLIDING, spark_dims

LAYERS_1_7B = 28
SLIDING_PER_FULL = 3  # the layer pattern repeats: three sliding-window layers, then one full layer


def default_layer_types(layers: int) -> list[str]:
    return [FULL if (i + 1) % (SLIDING_PER_FULL + 1) == 0 else SLIDING for i in range(layers)]


def default_rope_parameters() -> dict[str, dict[str, float | str]]:
    return {
        SLIDING: {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
        FULL: {"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.25},
    }


@strict
class SparkConfig(PreTrainedConfig):
    model_type = MODEL_TYPE
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 131072
    hidden_size: int = 2048
    intermediate_size: int = 6656
    num_hidden_layers: int = LAYERS_1_7B
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 256
    hidden_act: str = "gelu"
    max_position_embeddings: int = 1048576
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool = True
    rope_parameters: dict | None = None
    attention_bias: bool = False
    attention_dropout: float = 0.0
    mlp_bias: bool = False
    headwise_attn_output_gate: bool = True
    gate_attn_act_mode: str = "sigmoid"
    sliding_window: int | None = 512
    layer_types: list[str] | None = None

    def __post_init__(self, **kwargs):
        if self.layer_types is None:
            self.layer_types = default_layer_types(self.num_hidden_layers)
        if self.rope_parameters is None:
            self.rope_parameters = default_rope_parameters()
        super().__post_init__(**kwargs)

    def validate_architecture(self) -> None:
        """Part of @strict validation: the same checks the model and the writers apply."""
        spark_dims(self.to_dict())


def register_config() -> None:
    """Make AutoConfig resolve model_type "spark2_5" to SparkConfig (idempotent)."""
    AutoConfig.register(MODEL_TYPE, SparkConfig, exist_ok=True)
