"""Open a checkpoint source by what it is: a GGUF file or a Hugging Face folder."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from spark_edge.checkpoints.default_model import DEFAULT_MODEL_ID, default_gguf
from spark_edge.checkpoints.fingerprint import file_sha256
from spark_edge.checkpoints.safetensors_stream import TensorSpec
from spark_edge.errors import CheckpointError


class CheckpointSource(Protocol):
    kind: str
    path: Path

    def hf_config(self) -> dict[str, Any]: ...
    def tensor_specs(self) -> list[TensorSpec]: ...
    def load(self, name: str) -> torch.Tensor: ...
    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]: ...
    def save_tokenizer(self, out: Path) -> None: ...
    def fingerprint(self) -> dict[str, Any]: ...


def resolve_model(model: str | Path | None) -> Path:
    return default_gguf() if model is None else Path(model).expanduser()


def open_source(model: str | Path | None) -> CheckpointSource:
    from spark_edge.checkpoints.gguf_source import GGUFSource
    from spark_edge.checkpoints.hf_source import HFSource

    path = resolve_model(model)
    if path.is_dir():
        return HFSource(path)
    if path.exists() or path.suffix == ".gguf":
        return GGUFSource(path)
    raise CheckpointError(f"{path}: no such file or folder")


def gguf_fingerprint(path: Path) -> dict[str, Any]:
    """What a build from this GGUF records of it: the file's identity, without parsing it."""
    return {"kind": "gguf", "path": str(path.resolve()), "sha256": file_sha256(path)}


def source_fingerprint(model: str | Path | None) -> dict[str, Any]:
    """`open_source(model).fingerprint()`, without parsing a GGUF (seconds: its vocabulary, the meta model):
    what `serve` compares with a build's manifest at every start."""
    path = resolve_model(model)
    if path.is_file() and not path.is_dir():
        return gguf_fingerprint(path)
    return open_source(model).fingerprint()


def model_id(model: str | Path | None) -> str:
    """A short, stable folder name for a model: its name plus a hash of where it lives."""
    if model is None:
        return DEFAULT_MODEL_ID
    path = Path(model).expanduser().resolve()
    name = path.name if path.is_dir() else path.stem  # a folder's dots are its name's ("smollm2-1.7b")
    stem = re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-") or "model"
    return f"{stem}-{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"
