"""Model architectures vLLM does not ship, registered out of tree from the plugin.

- `declared_layout`: what such a model declares about its checkpoint's tensors (DECLARED_LAYOUTS lists them).
- `spark_layout`: Spark-X2.5's config fields and checkpoint tensor names (no torch, no vLLM).
- `spark_config`: its Hugging Face config class (model_type "spark2_5"), so no remote code runs.
- `head_gate`: the head-wise output gate as an opaque custom op.
- `spark`: the vLLM model (`Spark2_5ForCausalLM`), imported lazily by vLLM's registry.
- `tiny_spark`: a small Spark-shaped checkpoint with random weights, for tests.

Its independent plain-PyTorch reference lives with the tests that use it (tests/spark_reference.py).
"""

from __future__ import annotations

from spark_edge.models import spark_layout
from spark_edge.models.spark_layout import ARCHITECTURE

# the checkpoint layouts of the models here: the generic checkpoint code reads these, never a model by name
DECLARED_LAYOUTS = (spark_layout.LAYOUT,)

SPARK_MODEL_CLASS = "spark_edge.models.spark:SparkForCausalLM"


def register_models() -> None:
    """Make vLLM (and transformers' AutoConfig) know the Spark architecture; cheap and idempotent."""
    from vllm import ModelRegistry

    from spark_edge.models.spark_config import register_config

    register_config()
    # A "module:class" string: vLLM imports the model only where it builds one.
    ModelRegistry.register_model(ARCHITECTURE, SPARK_MODEL_CLASS)
