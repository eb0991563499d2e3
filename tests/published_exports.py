"""Published 4-bit checkpoints as their exporters lay them out, written for tests and measurements.

- publish_gptq: a w4a8 build (spark-edge's GPTQ writer, whose layout tests/test_families.py checks against
  vLLM's own GPTQ loader) as an AutoGPTQ v1 export: no manifest, the head in bf16 (lm_head: false).
- asym_act_order_gptq: the same rewritten asymmetric with act-order (random zero points, shuffled g_idx).
- write_ct: every decoder Linear quantized and packed by the compressed-tensors library's own compressor.
- ct_decoded_bf16: a compressed-tensors export decoded by the library itself into a plain bf16 folder (what
  its weights are, served without any 4-bit reader: the fidelity control).
- write_awq: every decoder Linear quantized as AutoAWQ's GEMM export (min-max asymmetric groups; the activation
  scaling AWQ searches for is folded into the weights, so the format is the same), packed by vLLM's own
  `awq_pack`, the packer vLLM's AWQ tests use.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from spark_edge.checkpoints.architecture import structure
from spark_edge.checkpoints.manifest import MANIFEST_NAME
from spark_edge.formats.gptq_layout import pack_along_dim1, unpack_along_dim1
from spark_edge.vllm_methods import published_gptq as pg

from spark_reference import _gptq_weight


def publish_gptq(w4a8_build: Path, out: Path) -> Path:
    """The w4a8 build as an AutoGPTQ export: no manifest, the head in bf16 (lm_head: false)."""
    shutil.copytree(w4a8_build, out)
    (out / MANIFEST_NAME).unlink()
    tensors = load_file(out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    group = config["quantization_config"]["group_size"]
    head = _gptq_weight(tensors, "lm_head", group, 1)
    for suffix in pg.SUFFIXES:
        tensors.pop(f"lm_head.{suffix}")
    tensors["lm_head.weight"] = head.to(torch.bfloat16).contiguous()
    save_file(tensors, out / "model.safetensors")
    config["quantization_config"]["lm_head"] = False
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def asym_act_order_gptq(published: Path, out: Path, seed: int = 11) -> Path:
    """Rewrite every layer's zero points at random and shuffle its g_idx (one shuffle per input size, as q/k/v
    and gate/up, fed the same activations, share GPTQ's act-order permutation)."""
    shutil.copytree(published, out)
    tensors = load_file(out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    group = config["quantization_config"]["group_size"]
    gen = torch.Generator().manual_seed(seed)
    shuffles: dict[int, torch.Tensor] = {}
    for name in [n for n in tensors if n.endswith(".qzeros")]:
        prefix = name.removesuffix(".qzeros")
        zeros = unpack_along_dim1(tensors[name])
        tensors[name] = pack_along_dim1(torch.randint(4, 12, zeros.shape, generator=gen))
        k = tensors[f"{prefix}.g_idx"].numel()
        if k not in shuffles:
            shuffles[k] = (torch.arange(k, dtype=torch.int32) // group)[torch.randperm(k, generator=gen)]
        tensors[f"{prefix}.g_idx"] = shuffles[k].clone()
    save_file(tensors, out / "model.safetensors")
    config["quantization_config"].update(sym=False, desc_act=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def write_ct(source: Path, out: Path, symmetric: bool, act_order: bool, group: int = 32) -> Path:
    """Every decoder Linear quantized and packed by compressed-tensors itself (min-max group scales, as its
    memoryless observer computes them), the config its QuantizationConfig dumps; table and tied head kept."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(
        num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group,
        actorder="group" if act_order else None,
    )  # fmt: skip
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    config = json.loads((source / "config.json").read_text())
    linears = set(structure(config).linears)
    gen = torch.Generator().manual_seed(7)
    orders: dict[str, torch.Tensor] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        if name not in linears:
            tensors[name] = tensor
            continue
        w = tensor.float()
        n, k = w.shape
        g_idx = torch.arange(k, dtype=torch.int32) // group
        if act_order:  # one column order per merged layer's parts (they read the same activations)
            key = name.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
            if key not in orders:
                orders[key] = torch.randperm(k, generator=gen)
            g_idx = g_idx[orders[key]]
        grouped = w[:, torch.sort(g_idx.long(), stable=True).indices].view(n, k // group, group)
        scale, zero_point = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
        state = {"weight": w, "weight_scale": scale, "weight_zero_point": zero_point}
        if act_order:
            state["weight_g_idx"] = g_idx
        prefix = name.removesuffix(".weight")
        for key, value in PackedQuantizationCompressor.compress(state, scheme).items():
            tensors[f"{prefix}.{key}"] = value.contiguous()
    out.mkdir()
    _copy_besides_weights(source, out)
    save_file(tensors, out / "model.safetensors")
    quant = QuantizationConfig(
        config_groups={"group_0": scheme}, format="pack-quantized", ignore=["lm_head"], quantization_status="compressed"
    )
    config["quantization_config"] = quant.model_dump(mode="json")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def write_awq(source: Path, out: Path, group: int = 32) -> Path:
    from vllm.model_executor.layers.quantization.utils.quant_utils import awq_pack

    config = json.loads((source / "config.json").read_text())
    linears = set(structure(config).linears)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        if name not in linears:
            tensors[name] = tensor
            continue
        w = tensor.float()
        n, k = w.shape
        grouped = w.view(n, k // group, group)
        lo, hi = grouped.amin(-1), grouped.amax(-1)
        scales = ((hi - lo).clamp(min=1e-5) / 15).to(torch.float16)
        zeros = (-torch.round(lo / scales.float())).clamp(0, 15).to(torch.int32)
        codes = (torch.round(grouped / scales.float().unsqueeze(-1)) + zeros.unsqueeze(-1)).clamp(0, 15)
        codes = codes.to(torch.int32).view(n, k)
        prefix = name.removesuffix(".weight")
        tensors[f"{prefix}.qweight"] = awq_pack(codes.t().contiguous(), 4, k, n)
        tensors[f"{prefix}.qzeros"] = awq_pack(zeros.t().contiguous(), 4, k // group, n)
        tensors[f"{prefix}.scales"] = scales.t().contiguous()
    out.mkdir()
    _copy_besides_weights(source, out)
    save_file(tensors, out / "model.safetensors")
    config["quantization_config"] = {
        "quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
        "modules_to_not_convert": None,
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _copy_besides_weights(source: Path, out: Path) -> None:
    """Config, tokenizer and the like; not the weights, nor a spark-edge build's manifest (an export has none)."""
    for f in source.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", MANIFEST_NAME) and not f.name.startswith("."):
            shutil.copy(f, out / f.name)


def ct_decoded_bf16(folder: Path, out: Path) -> Path:
    from spark_reference import _ct_scheme, _ct_weight

    config = json.loads((folder / "config.json").read_text())
    scheme = _ct_scheme(config.pop("quantization_config"))
    tensors = load_file(folder / "model.safetensors")
    prefixes = {n.removesuffix(".weight_packed") for n in tensors if n.endswith(".weight_packed")}
    plain = {n: v for n, v in tensors.items() if not any(n.startswith(p + ".weight_") for p in prefixes)}
    plain.update({f"{p}.weight": _ct_weight(tensors, p, scheme).to(torch.bfloat16).contiguous() for p in prefixes})
    out.mkdir()
    _copy_besides_weights(folder, out)
    save_file(plain, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
