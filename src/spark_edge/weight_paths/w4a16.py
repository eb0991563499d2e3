"""w4a16: 4-bit group-wise weights, bf16 activations, served by the "cpu_int4" method.

Every Linear weight of the decoder blocks, as the architecture's own module tree says
(spark_edge.checkpoints.architecture: Llama's q/k/v/o and gate/up/down, Phi-3's fused
qkv_proj and gate_up_proj, Spark-X2.5's q_k_v_proj and out_proj, ...), is quantized with
spark_edge.formats.int4_asym; the token embedding and an untied head with spark_edge.formats.int8_rows
(or int4_asym, embedding_bits 4); norms, biases and Spark's head gate (g_proj, 0.001% of the weights)
stay bf16.  Tensor names are kept: vLLM's loaders split a fused tensor by rows, which is exact here
(N stays on dim 0).  Streaming: one source tensor is loaded, quantized and written at a time.

Params:
  group_size      K elements per (scale, zero) group; default 32 (the default model's
                  weights came from Q4_1, groups of 32: g32 costs x1.05 perplexity, g64 x1.45)
  search          per-group range-shrink search (default true); false = plain min/max
  keep_embedding  leave the embedding / LM head in bf16 (default false)
  embedding_bits  8 (default: per-row int8, the head on vLLM's int8 GEMM) or 4 (group-wise, as the
                  linears). On the default model, whose source table is Q8_0, the whole w4a16 build
                  scored x1.061 bf16's perplexity with 4 bits and x1.007 with 8 (Intel Xeon AMX)
  direct_dequant  serve-time switch written into quantization_config (default true)

Also writes quantization_report.json (per-tensor SNR, bits per weight) into the checkpoint.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from spark_edge.checkpoints.architecture import Role, Structure, servable_structure
from spark_edge.checkpoints.safetensors_stream import TensorSpec, write_safetensors
from spark_edge.checkpoints.sources import CheckpointSource
from spark_edge.errors import CheckpointError
from spark_edge.formats import int8_rows
from spark_edge.formats.cpu_int4_config import DEFAULT_GROUP_SIZE, CpuInt4Settings
from spark_edge.formats.int4_asym import bits_per_weight, quantize
from spark_edge.formats.tinygemm_layout import kernel_supports
from spark_edge.registry import W4A16_EMBEDDING_BITS

REPORT_NAME = "quantization_report.json"
_PARAMS = {"group_size": int, "search": bool, "keep_embedding": bool, "embedding_bits": int, "direct_dequant": bool}


@dataclass(frozen=True)
class _Options:
    settings: CpuInt4Settings
    search: bool


@dataclass(frozen=True)
class _Item:
    name: str  # source tensor name
    shape: tuple[int, ...]
    action: str  # "int4" | "int8" | "bf16" | "drop"


def _options(params: dict[str, Any]) -> _Options:
    unknown = sorted(set(params) - set(_PARAMS))
    if unknown:
        raise CheckpointError(f"w4a16: unknown params {unknown} (known: {sorted(_PARAMS)})")
    for key, kind in _PARAMS.items():
        value = params.get(key)
        if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
            raise CheckpointError(f"w4a16: param {key} must be {kind.__name__}, got {value!r}")
    try:
        settings = CpuInt4Settings(
            group_size=params.get("group_size", DEFAULT_GROUP_SIZE),
            quantize_embedding=not params.get("keep_embedding", False),
            embedding_bits=params.get("embedding_bits", W4A16_EMBEDDING_BITS),
            direct_dequant=params.get("direct_dequant", True),
        )
    except ValueError as exc:
        raise CheckpointError(f"w4a16: {exc}") from exc
    return _Options(settings, params.get("search", True))


def _action(role: Role, opts: _Options) -> str:
    if role is Role.TIED_HEAD:
        return "drop"  # tied: vLLM builds the head from the embedding and would skip this copy
    if role in (Role.EMBEDDING, Role.HEAD):
        if not opts.settings.quantize_embedding:
            return "bf16"
        return "int8" if opts.settings.embedding_bits == 8 else "int4"
    return "int4" if role is Role.LINEAR else "bf16"  # norms, biases, Spark's head gate


def _check_quantizable(item: _Item, group_size: int, tables: tuple[str, str]) -> None:
    if len(item.shape) != 2:
        raise CheckpointError(f"w4a16: {item.name} has shape {list(item.shape)}, expected 2-D")
    n, k = item.shape
    if k % group_size:
        raise CheckpointError(f"w4a16: {item.name}: K={k} is not a multiple of group size {group_size}")
    # vLLM pads the vocab to a multiple of 64 before packing, so only linears need the check
    if item.name not in tables and not kernel_supports(n):
        raise CheckpointError(f"w4a16: {item.name}: N={n} is not a multiple of 16 (CPU int4 kernel)")


def _plan(source: CheckpointSource, opts: _Options) -> list[_Item]:
    arch: Structure = servable_structure(source.hf_config())
    items = [
        _Item(s.name, tuple(s.shape), _action(arch.role(s.name, tuple(s.shape)), opts)) for s in source.tensor_specs()
    ]
    for item in items:
        if item.action == "int4":
            _check_quantizable(item, opts.settings.group_size, (arch.embedding, arch.head))
        elif item.action == "int8" and len(item.shape) != 2:
            raise CheckpointError(f"w4a16: {item.name} has shape {list(item.shape)}, expected 2-D")
    return items


def _quantized_name(name: str, suffix: str) -> str:
    return name[: -len(".weight")] + "." + suffix


def _specs(items: list[_Item], group_size: int) -> list[TensorSpec]:
    specs: list[TensorSpec] = []
    for item in items:
        if item.action == "bf16":
            specs.append(TensorSpec(item.name, torch.bfloat16, item.shape))
        elif item.action == "int4":
            n, k = item.shape
            specs.append(TensorSpec(_quantized_name(item.name, "weight_packed"), torch.uint8, (n, k // 2)))
            specs.append(TensorSpec(_quantized_name(item.name, "weight_scale"), torch.bfloat16, (n, k // group_size)))
            specs.append(TensorSpec(_quantized_name(item.name, "weight_zero"), torch.bfloat16, (n, k // group_size)))
        elif item.action == "int8":
            n, k = item.shape
            specs.append(TensorSpec(_quantized_name(item.name, "weight_int8"), torch.int8, (n, k)))
            specs.append(TensorSpec(_quantized_name(item.name, "weight_scale"), torch.float32, (n,)))
    return specs


def _stream(
    source: CheckpointSource, items: list[_Item], opts: _Options, report: dict[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    g = opts.settings.group_size
    for item in items:
        if item.action == "drop":
            continue
        tensor = source.load(item.name)
        if item.action == "bf16":
            yield item.name, tensor.to(torch.bfloat16)
            continue
        if item.action == "int8":
            rows = int8_rows.quantize(tensor)
            del tensor
            report[item.name] = {"shape": list(item.shape), "bits": 8, "snr_db": _finite(rows.snr_db)}
            yield _quantized_name(item.name, "weight_int8"), rows.codes
            yield _quantized_name(item.name, "weight_scale"), rows.scale
            continue
        q = quantize(tensor.float(), g, search=opts.search)
        del tensor
        report[item.name] = {"shape": list(item.shape), "snr_db": _finite(q.snr_db)}
        yield _quantized_name(item.name, "weight_packed"), q.packed
        yield _quantized_name(item.name, "weight_scale"), q.scale
        yield _quantized_name(item.name, "weight_zero"), q.zero


def _finite(x: float) -> float | None:
    return round(x, 3) if math.isfinite(x) else None  # JSON has no inf (an exactly representable tensor)


def _report(items: list[_Item], opts: _Options, tensors: dict[str, Any]) -> dict[str, Any]:
    g = opts.settings.group_size
    int4 = sum(math.prod(i.shape) for i in items if i.action == "int4")
    int8 = [i.shape for i in items if i.action == "int8"]
    bf16 = sum(math.prod(i.shape) for i in items if i.action == "bf16")
    int8_bits = sum(math.prod(shape) * int8_rows.bits_per_weight(shape[1]) for shape in int8)
    quantized = int4 + sum(math.prod(shape) for shape in int8)
    snrs = [t["snr_db"] for t in tensors.values() if t["snr_db"] is not None]
    return {
        "weight_path": "w4a16",
        "quantization_config": opts.settings.to_hf(),
        "group_size": g,
        "search": opts.search,
        "bits_per_weight": bits_per_weight(g),  # of a quantized tensor: 4-bit code + bf16 scale, zero
        "model_bits_per_weight": round(
            (int4 * bits_per_weight(g) + int8_bits + bf16 * 16) / max(1, quantized + bf16), 4
        ),
        "quantized_params": quantized,
        "int8_params": quantized - int4,
        "bf16_params": bf16,
        "dropped": [i.name for i in items if i.action == "drop"],
        "snr_db_min": min(snrs) if snrs else None,
        "snr_db_mean": round(sum(snrs) / len(snrs), 3) if snrs else None,
        "tensors": tensors,
    }


def write_w4a16(source: CheckpointSource, out: Path, params: dict[str, Any]) -> dict[str, Any]:
    opts = _options(params)
    items = _plan(source, opts)
    tensors: dict[str, Any] = {}
    write_safetensors(out, _specs(items, opts.settings.group_size), _stream(source, items, opts, tensors))
    report = _report(items, opts, tensors)
    (out / REPORT_NAME).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return {"quantization_config": opts.settings.to_hf()}
