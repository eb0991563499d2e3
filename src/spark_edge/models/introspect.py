"""What a loaded Spark model looks like inside vLLM's worker, as plain data.

Passed to `LLM.apply_model` (it is pickled by reference, so it must live in an importable
module, not in a test): which kernels each weight runs on, the RoPE tables actually
allocated, each layer's attention window. Used by the tests and handy when a served
model misbehaves.
"""

from __future__ import annotations

from typing import Any

import torch


def _kernel(layer: torch.nn.Module) -> str:
    method = getattr(layer, "quant_method", None)
    name = type(method).__name__ if method is not None else "none"
    if getattr(layer, "use_w4a8", False):
        name += "+w4a8"  # vLLM's AMX int4 x int8 kernel
    return name


def spark_model_facts(model: torch.nn.Module) -> dict[str, Any]:
    layers = model.model.layers
    ropes = {
        (tuple(b.shape), str(b.dtype).removeprefix("torch."))
        for n, b in model.named_buffers()
        if n.endswith("cos_sin_cache")
    }
    return {
        "class": type(model).__name__,
        "rope_tables": sorted([list(shape), dtype] for shape, dtype in ropes),
        "windows": [layer.self_attn.attn.impl.sliding_window for layer in layers],
        "gate": [type(layer.self_attn.g_proj.weight).__name__ for layer in layers],
        "gate_dtype": str(layers[0].self_attn.g_proj.weight.dtype).removeprefix("torch."),
        "kernels": {
            "qkv_proj": _kernel(layers[0].self_attn.qkv_proj),
            "out_proj": _kernel(layers[0].self_attn.out_proj),
            "gate_up_proj": _kernel(layers[0].mlp.gate_up_proj),
            "down_proj": _kernel(layers[0].mlp.down_proj),
            "embed_tokens": _kernel(model.model.embed_tokens),
            "lm_head": _kernel(model.lm_head),
        },
        "w4a8_linears": sum(bool(getattr(m, "use_w4a8", False)) for m in model.modules()),
        "head_tied": _shares_storage(model.lm_head, model.model.embed_tokens),
    }


def _shares_storage(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    ptrs = lambda m: {t.data_ptr() for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))}  # noqa: E731
    return a is b or bool(ptrs(a) & ptrs(b))
