"""bf16: the source's weights cast to bfloat16, unquantized."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from spark_edge.checkpoints.safetensors_stream import TensorSpec, write_safetensors
from spark_edge.checkpoints.sources import CheckpointSource


def write_bf16(source: CheckpointSource, out: Path, params: dict[str, Any]) -> dict[str, Any]:
    specs = [TensorSpec(s.name, torch.bfloat16, s.shape) for s in source.tensor_specs()]
    write_safetensors(out, specs, ((name, t.to(torch.bfloat16)) for name, t in source.tensors()))
    return {}
