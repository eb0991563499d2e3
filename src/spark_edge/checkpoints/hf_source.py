"""A Hugging Face checkpoint folder (config.json + safetensors) as a checkpoint source."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from spark_edge.checkpoints.fingerprint import files_sha256
from spark_edge.checkpoints.safetensors_stream import TensorSpec
from spark_edge.errors import CheckpointError

# Files besides the weights that a served checkpoint needs
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


class HFSource:
    kind = "hf"

    def __init__(self, path: Path):
        self.path = Path(path)
        config_path = self.path / "config.json"
        if not config_path.is_file():
            raise CheckpointError(f"{self.path}: not a Hugging Face checkpoint (no config.json)")
        try:
            self._config = json.loads(config_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{config_path}: not valid JSON ({exc})") from exc
        if not self._config.get("architectures"):
            raise CheckpointError(f"{config_path}: no 'architectures' entry")
        if "quantization_config" in self._config:
            raise CheckpointError(
                f"{self.path}: already quantized; build from a full-precision checkpoint, or serve a published "
                "GPTQ, AWQ or compressed-tensors folder as it is: spark-edge serve --model FOLDER"
            )
        self._files = sorted(self.path.glob("*.safetensors"))
        if not self._files:
            hint = (
                " (PyTorch .bin weights are not supported; save as safetensors)" if any(self.path.glob("*.bin")) else ""
            )
            raise CheckpointError(f"{self.path}: no *.safetensors weights{hint}")
        self._where = self._index()

    def _index(self) -> dict[str, tuple[Path, tuple[int, ...]]]:
        from safetensors import safe_open

        where: dict[str, tuple[Path, tuple[int, ...]]] = {}
        for f in self._files:
            try:
                with safe_open(f, framework="pt") as st:
                    for name in st.keys():
                        where[name] = (f, tuple(st.get_slice(name).get_shape()))
            except Exception as exc:
                raise CheckpointError(f"{f}: unreadable safetensors ({exc})") from exc
        return where

    def hf_config(self) -> dict[str, Any]:
        config = dict(self._config)
        config["torch_dtype"] = "bfloat16"
        config.pop("dtype", None)
        return config

    def tensor_specs(self) -> list[TensorSpec]:
        return [TensorSpec(name, torch.float32, shape) for name, (_, shape) in self._where.items()]

    def load(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        f, _ = self._where[name]
        try:
            with safe_open(f, framework="pt") as st:
                return st.get_tensor(name)
        except Exception as exc:
            raise CheckpointError(f"{f}: cannot read tensor {name} ({exc})") from exc

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self._where:
            yield name, self.load(name)

    def save_tokenizer(self, out: Path) -> None:
        found = [n for n in TOKENIZER_FILES if (self.path / n).is_file()]
        if not any(n in found for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
            raise CheckpointError(f"{self.path}: no tokenizer files")
        for name in found:
            shutil.copy2(self.path / name, out / name)

    def fingerprint(self) -> dict[str, Any]:
        inputs = [self.path / "config.json", *self._files]
        inputs += [self.path / n for n in TOKENIZER_FILES if (self.path / n).is_file()]
        return {"kind": self.kind, "path": str(self.path.resolve()), "sha256": files_sha256(inputs, self.path)}
