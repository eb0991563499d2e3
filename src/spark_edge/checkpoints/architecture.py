"""What each tensor of a source checkpoint is, read from its architecture's module tree.

The 4-bit writers quantize every Linear weight of the decoder blocks and nothing else. Which
tensors those are is not a list of names: it is read from the model itself, built by Hugging
Face transformers on the meta device (no memory, no weights) from the checkpoint's config, so a
family's own structure decides (Phi-3's fused `qkv_proj` and `gate_up_proj`, Qwen2's biases,
Qwen3's and Gemma 3's q/k norms). A model transformers does not build (Spark-X2.5) declares its
layout itself (spark_edge.models.DECLARED_LAYOUTS).

Also refused here, before anything is written: an architecture vLLM does not implement itself
(its generic Transformers backend is not one the 4-bit methods were verified on), and a tensor
that is neither a decoder Linear, the token table, the head, nor a vector (norm, bias).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from enum import Enum
from typing import Any

from spark_edge.errors import CheckpointError
from spark_edge.models import DECLARED_LAYOUTS
from spark_edge.models.declared_layout import DeclaredLayout


class Role(Enum):
    LINEAR = "linear"  # a Linear weight of a decoder block: what 4-bit paths quantize
    EMBEDDING = "embedding"  # the token table
    HEAD = "head"  # the output head's own tensor (an untied source)
    TIED_HEAD = "tied_head"  # a head tensor the config ties to the table: a copy nobody reads
    FULL_PRECISION = "full_precision"  # a plain parameter its model declares (Spark's head gate): never 4-bit
    VECTOR = "vector"  # norms and biases, kept in bf16


@dataclass(frozen=True)
class Structure:
    architecture: str
    linears: frozenset[str]  # weight names of the decoder blocks' Linear modules
    embedding: str
    head: str  # the head's weight name in this architecture (read from the table when tied)
    tied: bool
    full_precision_suffixes: tuple[str, ...] = ()  # plain matrices the model declares (DeclaredLayout)

    def role(self, name: str, shape: tuple[int, ...]) -> Role:
        if name == self.embedding:
            return Role.EMBEDDING
        if name == self.head:
            return Role.TIED_HEAD if self.tied else Role.HEAD
        if name in self.linears:
            return Role.LINEAR
        if self.full_precision_suffixes and name.endswith(self.full_precision_suffixes):
            return Role.FULL_PRECISION
        if len(shape) == 1:
            return Role.VECTOR
        raise CheckpointError(
            f"{self.architecture}: tensor {name} {list(shape)} is not a Linear weight of a decoder block, the "
            "token table, the head, a norm or a bias; refusing to guess how to store it"
        )


def architecture_of(config: dict[str, Any]) -> str:
    architectures = config.get("architectures") or []
    if len(architectures) != 1:
        raise CheckpointError(f"config.json names {len(architectures)} architectures ({architectures}); expected one")
    return str(architectures[0])


def check_vllm_implements(architecture: str) -> None:
    """vLLM must serve the architecture with a model of its own, not its generic Transformers backend."""
    from vllm.model_executor.models.registry import ModelRegistry

    from spark_edge.models import register_models

    register_models()  # Spark-X2.5, which vLLM does not ship
    entry = ModelRegistry.models.get(architecture)
    if entry is None:
        raise CheckpointError(f"vLLM {_vllm_version()} does not serve the architecture {architecture}")
    module = getattr(entry, "module_name", "") or ""
    if module.rsplit(".", 1)[-1] == "transformers":
        raise CheckpointError(
            f"vLLM {_vllm_version()} serves {architecture} only through its generic Transformers backend, which "
            "spark-edge's weight paths are not verified on"
        )


def _vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def structure(config: dict[str, Any]) -> Structure:
    """The tensor roles of the architecture `config` describes."""
    architecture = architecture_of(config)
    tied = bool(config.get("tie_word_embeddings", False))
    if (declared := declared_layout(config)) is not None:
        return _DeclaredStructure(
            architecture,
            frozenset(),
            declared.embedding,
            declared.head,
            tied,
            declared.full_precision_suffixes,
            declared.linear_suffixes,
        )
    return _transformers_structure(json.dumps(config, sort_keys=True))


def declared_layout(config: dict[str, Any]) -> DeclaredLayout | None:
    """The layout a model transformers does not build declares for this config, if any."""
    return next((layout for layout in DECLARED_LAYOUTS if layout.matches(config)), None)


@dataclass(frozen=True)
class _DeclaredStructure(Structure):
    linear_suffixes: tuple[str, ...] = ()

    def role(self, name: str, shape: tuple[int, ...]) -> Role:
        if name.startswith("model.layers.") and name.endswith(self.linear_suffixes):
            return Role.LINEAR
        return super().role(name, shape)


def servable_structure(config: dict[str, Any]) -> Structure:
    """structure(config), for a writer whose checkpoint vLLM must serve with a model of its own."""
    check_vllm_implements(architecture_of(config))
    return structure(config)


def tensor_shapes(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor a checkpoint of this (transformers-built) architecture holds, in module order; a tied
    head's copy is left out, as Hugging Face writes it."""
    model = _meta_model(json.dumps(config, sort_keys=True))
    arch = structure(config)
    return [(name, tuple(t.shape)) for name, t in model.state_dict().items() if not (arch.tied and name == arch.head)]


@functools.lru_cache(maxsize=8)
def _meta_model(config_json: str) -> Any:
    """The transformers model of a config.json, on the meta device (shapes only, no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = json.loads(config_json)
    architecture = architecture_of(config)
    fields = {k: v for k, v in config.items() if k not in ("model_type", "quantization_config", "torch_dtype", "dtype")}
    try:
        hf_config = AutoConfig.for_model(str(config.get("model_type")), **fields)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
    except Exception as exc:  # transformers raises ValueError, KeyError, AssertionError for configs it cannot build
        raise CheckpointError(f"{architecture}: transformers cannot build this model from config.json ({exc})") from exc
    if type(model).__name__ != architecture:
        raise CheckpointError(f"config.json names {architecture}, but its model_type builds {type(model).__name__}")
    return model


@functools.lru_cache(maxsize=8)
def _transformers_structure(config_json: str) -> Structure:
    import torch

    model = _meta_model(config_json)
    architecture = type(model).__name__
    names = {module: name for name, module in model.named_modules()}
    embedding = names[model.get_input_embeddings()] + ".weight"
    head = names[model.get_output_embeddings()] + ".weight"
    blocks = [name for name, module in model.named_modules() if isinstance(module, torch.nn.ModuleList)]
    linears = frozenset(
        f"{name}.weight"
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and any(name.startswith(b + ".") for b in blocks)
    )
    if not linears:
        raise CheckpointError(f"{architecture}: found no Linear modules in its decoder blocks")
    # the config class's default decides when config.json is silent (Gemma 3 ties, Llama does not)
    return Structure(architecture, linears, embedding, head, bool(getattr(model.config, "tie_word_embeddings", False)))
