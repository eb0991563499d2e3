"""vLLM plugin entry point (group `vllm.general_plugins`, see pyproject.toml).

vLLM calls `register()` in every process it starts (engine core, workers, API server),
so what it registers exists wherever a model is built.  It must stay cheap and
idempotent: importing a module twice is a no-op, and the op registration checks first.
"""

from __future__ import annotations


def register() -> None:
    """Make spark-edge's quantization methods and models known to vLLM and apply its runtime fixes."""
    # Imported for its side effect: registers the "cpu_int4" quantization config.  It is
    # light on purpose; its layer methods and custom ops load when a model is built.
    import spark_edge.vllm_methods.cpu_int4_method  # noqa: F401
    import spark_edge.vllm_methods.published_methods  # noqa: F401  (published GPTQ and compressed-tensors checkpoints)
    from spark_edge.models import register_models
    from spark_edge.runtime.fixes import apply_runtime_fixes

    # Architectures vLLM does not ship (Spark-X2.5), registered lazily by "module:class".
    register_models()
    # Every runtime patch of vLLM (compile cache that never loads on CPU, memory release after
    # load and warm-up, compile-cache hit/miss accounting): see spark_edge/runtime/fixes.py.
    apply_runtime_fixes()
