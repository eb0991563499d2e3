"""Model architectures vLLM does not ship, registered out of tree from the plugin.

- `spark_layout`: Spark-X2.5's config fields and checkpoint tensor names (no torch, no vLLM).
- `spark_config`: its Hugging Face config class (model_type "spark2_5"), so no remote code runs.
- `head_gate`: the head-wise output gate as an opaque custom op.
- `spark`: the vLLM model (`Spark2_5ForCausalLM`), imported lazily by vLLM's registry.
- `tiny_spark`: a small Spark-shaped checkpoint with random weights, for tests.

Its independent plain-PyTorch reference lives with the tests that use it (tests/spark_reference.py).
"""

from __future__ import annotations

from spark_edge.models.spark_layout import ARCHITECTURE

SPARK_MODEL_CLASS = "spark_edge.models.spark:SparkForCausalLM"


def register_models() -> None:
    """Make vLLM (and transformers' AutoConfig) know the Spark architecture; cheap and idempotent."""
    from vllm import ModelRegistry

    from spark_edge.models.spark_config import register_config

    register_config()
    # A "module:class" string: vLLM imports the model only where it builds one.
    ModelRegistry.register_model(ARCHITECTURE, SPARK_MODEL_CLASS)
