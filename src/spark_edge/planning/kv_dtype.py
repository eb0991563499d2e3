"""The KV cache's dtype: bf16 (vLLM's "auto" for a bf16 model) or fp8 (e4m3), and where fp8 can run.

vLLM 0.32's CPU attention keeps an fp8 KV cache on x86 with AVX-512 or AMX, for head sizes that are a
multiple of 32 (`vllm/v1/attention/backends/cpu_attn.py`, `_get_attn_isa`); elsewhere it raises while the
engine starts. So `serve` and `plan` refuse fp8 there first, saying why, and `auto` considers fp8 only
where it runs. fp8 halves the KV cache: `auto` takes it when the bf16 plan would serve a shorter context
than asked (or none at all) and fp8 serves a longer one, and the start log says so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spark_edge.errors import SettingRefused, SparkEdgeError, UnsupportedHostError
from spark_edge.probe.isa import amx_w4a8_ready, has_avx512

if TYPE_CHECKING:
    from spark_edge.planning.model_shape import ModelShape
    from spark_edge.probe.device import DeviceProfile

KV_DTYPES = ("auto", "bf16", "fp8")
KV_DTYPE_BYTES = {"bf16": 2, "fp8": 1}
# vLLM's --kv-cache-dtype for each ("auto": the model's dtype, bf16 on every weight path)
VLLM_KV_DTYPE = {"bf16": "auto", "fp8": "fp8"}
FP8_HEAD_MULTIPLE = 32


def fp8_problem(device: DeviceProfile, shape: ModelShape) -> SparkEdgeError | None:
    """The refusal (exit 4 for the host, 2 for the model) if an fp8 KV cache cannot run here; None if it can."""
    if not (has_avx512(device) or amx_w4a8_ready(device)):
        return UnsupportedHostError(
            "an fp8 KV cache needs x86-64 with AVX-512 or AMX (vLLM's CPU attention), and this host has "
            "neither: use --kv-cache-dtype bf16"
        )
    if shape.head_dim % FP8_HEAD_MULTIPLE:
        return SettingRefused(
            f"an fp8 KV cache needs a head size that is a multiple of {FP8_HEAD_MULTIPLE} (vLLM's CPU attention), "
            f"and this model's is {shape.head_dim}: use --kv-cache-dtype bf16"
        )
    return None
