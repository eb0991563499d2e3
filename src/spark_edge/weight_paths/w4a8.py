"""w4a8: symmetric 4-bit GPTQ weights for vLLM's own CPU kernel (AMX W4A8 where it can).

vLLM loads the checkpoint with its "gptq" method and its CPU kernel runs it as W4A8
(`int4_scaled_mm_cpu`, int8 activations on AMX) when the model runs in bf16 on an AMX
host, else as W4A16 (`cpu_gemm_wna16`).  Both fix the zero point at 8, so the grid is
symmetric (spark_edge.formats.int4_sym) and the tensors are AutoGPTQ's
(spark_edge.formats.gptq_layout).

What is quantized: every Linear of the decoder blocks, as the architecture's own module
tree says (spark_edge.checkpoints.architecture), and the output head.  Spark's head gate
(g_proj) stays bf16: the model holds it as a plain parameter.  The head matters most: it is the largest matrix read
per decode step,
and a bf16 head alone costs more per step than all the 4-bit savings.  A tied source is
therefore untied: the bf16 table stays for token lookup (vLLM's GPTQ method has no
quantized embedding) and a 4-bit `lm_head` is written beside it.  A fused `qkv_proj` /
`gate_up_proj` source tensor (and Spark's `q_k_v_proj`) is written as vLLM's model for the
architecture names it: split into q/k/v and gate/up tensors where that model loads the parts
(Spark: GPTQ puts N on dim 1 and packs K, so its loader could not split them by rows), kept
fused where it loads the fused tensor itself (Phi-3: its packed-module map names `qkv_proj` and
`gate_up_proj` alone, and a split checkpoint does not load).  Norms stay bf16.  Streaming: one
source tensor is loaded at a time.

Params:
  group_size  K elements per scale, one of 32/64/128 (what vLLM's GPTQ method accepts);
              default: the largest of them that divides every quantized K
              (the default model's K = 576 is not a multiple of 128, so 64)
  search      per-group squared-error scale search (default false: the plain -e/8 grid).
              On the default model the search raises weight SNR by 0.4 dB but costs
              perplexity (x2.71 against x1.57 for the plain grid, g64), because it
              clips group extremes; see spark_edge.formats.int4_sym

Also writes quantization_report.json (per-tensor SNR, bits per weight) into the checkpoint.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from spark_edge.checkpoints.architecture import Role, Structure, architecture_of, declared_layout, servable_structure
from spark_edge.checkpoints.safetensors_stream import TensorSpec, write_safetensors
from spark_edge.checkpoints.sources import CheckpointSource
from spark_edge.errors import CheckpointError
from spark_edge.formats import gptq_layout
from spark_edge.formats.int4_sym import SCALE_DTYPE
from spark_edge.registry import W4A8_GROUPS, w4a8_group

REPORT_NAME = "quantization_report.json"
LM_HEAD = "lm_head.weight"  # what vLLM's GPTQ loader reads the quantized head from
QKV = ".self_attn.qkv_proj."
GATE_UP = ".mlp.gate_up_proj."

# vLLM's CPU GPTQ kernel needs K and N of every Linear to be multiples of 32
KERNEL_MULTIPLE = 32
# ParallelLMHead pads the vocabulary to a multiple of 64; a quantized head only loads
# when that padding is empty (vLLM narrows packed head tensors to the unpadded vocab)
VOCAB_MULTIPLE = 64

_PARAMS: dict[str, type] = {"group_size": int, "search": bool}


@dataclass(frozen=True)
class _Item:
    """One output tensor (or quantized Linear) and the rows of the source tensor it comes from."""

    out: str  # output tensor name; for "gptq", the Linear's weight name (".weight" is replaced)
    source: str  # source tensor name
    rows: tuple[int, int] | None  # a row range of the source (split of a fused tensor)
    shape: tuple[int, ...]
    action: str  # "gptq" | "bf16"


@dataclass(frozen=True)
class _Options:
    group_size: int | None  # None: choose from the shapes
    search: bool


def _options(params: dict[str, Any]) -> _Options:
    unknown = sorted(set(params) - set(_PARAMS))
    if unknown:
        raise CheckpointError(f"w4a8: unknown params {unknown} (known: {sorted(_PARAMS)})")
    for key, kind in _PARAMS.items():
        value = params.get(key)
        if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
            raise CheckpointError(f"w4a8: param {key} must be {kind.__name__}, got {value!r}")
    group_size = params.get("group_size")
    if group_size is not None and group_size not in W4A8_GROUPS:
        raise CheckpointError(
            f"w4a8: group_size {group_size} is not one vLLM's GPTQ method accepts ({', '.join(map(str, W4A8_GROUPS))})"
        )
    return _Options(group_size, params.get("search", False))


@functools.cache
def vllm_fused_modules(architecture: str) -> frozenset[str]:
    """The fused modules ("qkv_proj", "gate_up_proj") that vLLM's model for `architecture` loads from a tensor
    of that very name (its packed-module map lists the fused name alone), rather than from its parts."""
    from vllm.model_executor.models.registry import ModelRegistry

    from spark_edge.models import register_models

    register_models()
    model = ModelRegistry._try_load_model_cls(architecture)
    packed = getattr(model, "packed_modules_mapping", None) or {}
    return frozenset(fused for fused, parts in packed.items() if list(parts) == [fused])


def _fused_parts(name: str, config: dict[str, Any]) -> list[tuple[str, int]] | None:
    """(unfused name, rows) of a fused qkv / gate_up tensor vLLM loads by its parts; None if `name` is not
    fused, or vLLM's model for the architecture loads it fused."""
    kept = vllm_fused_modules(architecture_of(config))
    declared = declared_layout(config)  # a model's own fused name (Spark's q_k_v_proj), beside vLLM's usual one
    fused_names = (QKV, declared.fused_qkv) if declared and declared.fused_qkv else (QKV,)
    fused = next((f for f in fused_names if f in name), None)
    if fused is not None and "qkv_proj" in kept and fused == QKV:
        return None
    if GATE_UP in name and "gate_up_proj" in kept:
        return None
    if fused is not None:
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        kv = int(config.get("num_key_value_heads") or heads) * head_dim
        parts = (("q_proj", heads * head_dim), ("k_proj", kv), ("v_proj", kv))
        return [(name.replace(fused, f".self_attn.{p}."), rows) for p, rows in parts]
    if GATE_UP in name:
        inter = int(config["intermediate_size"])
        return [(name.replace(".gate_up_proj.", f".{p}."), inter) for p in ("gate_proj", "up_proj")]
    return None


def _split(name: str, shape: tuple[int, ...], config: dict[str, Any]) -> list[_Item]:
    """A fused source tensor as the unfused items vLLM's Llama loader expects."""
    parts = _fused_parts(name, config)
    assert parts is not None
    total = sum(rows for _, rows in parts)
    if shape[0] != total:
        raise CheckpointError(
            f"w4a8: {name} has {shape[0]} rows; the config implies {total} "
            f"({' + '.join(str(r) for _, r in parts)}); refusing to guess the split"
        )
    items, start = [], 0
    for out, rows in parts:
        action = "gptq" if len(shape) == 2 else "bf16"
        items.append(_Item(out, name, (start, start + rows), (rows, *shape[1:]), action))
        start += rows
    return items


def _items_for(
    name: str, shape: tuple[int, ...], config: dict[str, Any], arch: Structure, head_source: str
) -> list[_Item]:
    role = arch.role(name, shape)
    if role is Role.EMBEDDING:
        items = [_Item(name, name, None, shape, "bf16")]
        if head_source == name:  # tied: the head is quantized from the same loaded table
            items.append(_Item(LM_HEAD, name, None, shape, "gptq"))
        return items
    if role in (Role.HEAD, Role.TIED_HEAD):
        return [_Item(LM_HEAD, name, None, shape, "gptq")] if head_source == name else []
    if _fused_parts(name, config) is not None:
        return _split(name, shape, config)
    return [_Item(name, name, None, shape, "gptq" if role is Role.LINEAR else "bf16")]


def _check_kernel_shape(item: _Item) -> None:
    if len(item.shape) != 2:
        raise CheckpointError(f"w4a8: {item.out} has shape {list(item.shape)}, expected 2-D")
    n, k = item.shape
    if n % KERNEL_MULTIPLE or k % KERNEL_MULTIPLE:
        raise CheckpointError(
            f"w4a8: {item.out} is {n} x {k}; vLLM's CPU GPTQ kernel needs both dimensions to be "
            f"multiples of {KERNEL_MULTIPLE}"
        )
    if item.out == LM_HEAD and n % VOCAB_MULTIPLE:
        raise CheckpointError(
            f"w4a8: vocabulary {n} is not a multiple of {VOCAB_MULTIPLE}; vLLM pads the head to one and "
            "cannot load a padded quantized head"
        )


def _choose_group_size(items: list[_Item], requested: int | None) -> int:
    if requested is not None:
        for item in items:
            if item.action == "gptq" and item.shape[1] % requested:
                raise CheckpointError(f"w4a8: group_size {requested} does not divide K={item.shape[1]} of {item.out}")
        return requested
    return w4a8_group(item.shape[1] for item in items if item.action == "gptq")


@dataclass(frozen=True)
class _Plan:
    items: list[_Item]
    group_size: int
    head_source: str  # the source tensor the head is quantized from: its own, or the table when tied
    dropped: list[str]  # source tensors not written (a tied source's own head copy)


def _plan(source: CheckpointSource, opts: _Options) -> _Plan:
    config = source.hf_config()
    arch = servable_structure(config)
    specs = source.tensor_specs()
    names = {s.name for s in specs}
    if arch.embedding not in names:
        raise CheckpointError(f"w4a8: the source has no token embedding ({arch.embedding})")
    head_source = arch.embedding if arch.tied or arch.head not in names else arch.head
    items: list[_Item] = []
    dropped: list[str] = []
    for spec in specs:
        produced = _items_for(spec.name, tuple(spec.shape), config, arch, head_source)
        items.extend(produced)
        if not produced:
            dropped.append(spec.name)
    outs = [item.out for item in items]
    if len(set(outs)) != len(outs):
        raise CheckpointError("w4a8: the source holds both fused and unfused copies of some tensors")
    for item in items:
        if item.action == "gptq":
            _check_kernel_shape(item)
    return _Plan(items, _choose_group_size(items, opts.group_size), head_source, dropped)


def _prefix(name: str) -> str:
    return name[: -len(".weight")]


def _specs(items: list[_Item], group_size: int) -> list[TensorSpec]:
    specs: list[TensorSpec] = []
    for item in items:
        if item.action == "bf16":
            specs.append(TensorSpec(item.out, torch.bfloat16, item.shape))
            continue
        n, k = item.shape
        for suffix, (dtype, shape) in gptq_layout.tensor_shapes(n, k, group_size).items():
            specs.append(TensorSpec(f"{_prefix(item.out)}.{suffix}", dtype, shape))
    return specs


def _stream(
    source: CheckpointSource, items: list[_Item], group_size: int, search: bool, report: dict[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    # Items of one source tensor (a fused tensor's parts, the tied table and its head) are
    # consecutive: each source tensor is loaded once, and released before the next is.
    for name, group in itertools.groupby(items, key=lambda item: item.source):
        yield from _stream_source(source.load(name), list(group), group_size, search, report)


def _stream_source(
    loaded: torch.Tensor, items: list[_Item], group_size: int, search: bool, report: dict[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    for item in items:
        tensor = loaded if item.rows is None else loaded[item.rows[0] : item.rows[1]]
        if item.action == "bf16":
            yield item.out, tensor.to(torch.bfloat16)
            continue
        q = gptq_layout.quantize(tensor.float(), group_size, search=search)
        n, k = item.shape
        report[_prefix(item.out)] = {
            "source": item.source if item.rows is None else f"{item.source}[{item.rows[0]}:{item.rows[1]}]",
            "shape": [n, k],
            "snr_db": _finite(q.snr_db),
            "bits_per_weight": round(gptq_layout.bits_per_weight(n, k, group_size), 4),
        }
        for suffix, t in q.tensors().items():
            yield f"{_prefix(item.out)}.{suffix}", t


def _finite(x: float) -> float | None:
    return round(x, 3) if math.isfinite(x) else None  # JSON has no inf (an exactly representable tensor)


def quantization_config(group_size: int) -> dict[str, Any]:
    """What vLLM's "gptq" method (AutoGPTQConfig) reads from config.json."""
    return {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group_size,
        "desc_act": False,  # vLLM 0.32 refuses activation reordering; g_idx is k // g
        "sym": True,  # zero point 8: what vLLM's CPU kernels compute
        "lm_head": True,  # the head is quantized too
        "checkpoint_format": "gptq",  # v1: qzeros hold zero point - 1
        "static_groups": False,
    }


def _report(plan: _Plan, search: bool, tensors: dict[str, Any]) -> dict[str, Any]:
    g = plan.group_size
    quantized = [i for i in plan.items if i.action == "gptq"]
    q_params = sum(math.prod(i.shape) for i in quantized)
    q_bits = sum(math.prod(i.shape) * gptq_layout.bits_per_weight(*i.shape, g) for i in quantized)
    bf16_params = sum(math.prod(i.shape) for i in plan.items if i.action == "bf16")
    snrs = [t["snr_db"] for t in tensors.values() if t["snr_db"] is not None]
    return {
        "weight_path": "w4a8",
        "quantization_config": quantization_config(g),
        "group_size": g,
        "search": search,
        "scale_dtype": str(SCALE_DTYPE).removeprefix("torch."),
        "lm_head_from": plan.head_source,
        "dropped": plan.dropped,
        # stored bits of the quantized tensors (codes, scales, qzeros, g_idx) per weight
        "bits_per_weight": round(q_bits / max(1, q_params), 4),
        "model_bits_per_weight": round((q_bits + 16 * bf16_params) / max(1, q_params + bf16_params), 4),
        "quantized_params": q_params,
        "bf16_params": bf16_params,
        "snr_db_min": min(snrs) if snrs else None,
        "snr_db_mean": round(sum(snrs) / len(snrs), 3) if snrs else None,
        "tensors": tensors,
    }


def write_w4a8(source: CheckpointSource, out: Path, params: dict[str, Any]) -> dict[str, Any]:
    opts = _options(params)
    plan = _plan(source, opts)
    tensors: dict[str, Any] = {}
    write_safetensors(
        out, _specs(plan.items, plan.group_size), _stream(source, plan.items, plan.group_size, opts.search, tensors)
    )
    report = _report(plan, opts.search, tensors)
    (out / REPORT_NAME).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    # untied: vLLM must build a separate (quantized) head instead of reusing the table
    return {"quantization_config": quantization_config(plan.group_size), "tie_word_embeddings": False}
