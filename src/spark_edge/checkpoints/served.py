"""What a checkpoint folder is, decided once: a spark-edge build, a published 4-bit export, or a source to build.

`serve`, `warm`, `plan` and `bench` take that answer (a CheckpointKind, and for a server the ServedCheckpoint
that carries it with the folder, its served name and its parsed config) instead of asking the folder again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from spark_edge.checkpoints.manifest import MANIFEST_NAME, read_manifest
from spark_edge.vllm_methods import published_awq, published_ct, published_gptq

# A published 4-bit checkpoint is served on the w4a16 path's kernels (repacked at load, never requantized).
PUBLISHED_WEIGHT_PATH = "w4a16"
BUILD, PUBLISHED, SOURCE = "build", "published", "source"
_READERS = (
    (published_gptq.METHOD, published_gptq.published_gptq, published_gptq.check_gptq_tensors),
    (published_awq.METHOD, published_awq.published_awq, published_awq.check_awq_tensors),
    (published_ct.METHOD, published_ct.published_ct, published_ct.check_ct_tensors),
)


@dataclass(frozen=True)
class CheckpointKind:
    kind: str  # BUILD (a folder `spark-edge build` made: its manifest), PUBLISHED, or SOURCE (built before serving)
    weight_path: str | None  # what a build was made for, PUBLISHED_WEIGHT_PATH for a published one, None for a source
    method: str | None = None  # PUBLISHED: the vLLM quantization method that reads it as it is (`--quantization`)


def checkpoint_kind(model: Path | None) -> CheckpointKind:
    """The one place a folder's kind is read (its manifest is checked in full when it is served)."""
    folder = None if model is None else Path(model)
    if folder is not None and (folder / MANIFEST_NAME).is_file():  # spark-edge's w4a8 builds are GPTQ too: not
        return CheckpointKind(BUILD, str(read_manifest(folder)["inputs"]["weight_path"]))  # a published one
    if folder is None or not (folder / "config.json").is_file():
        return CheckpointKind(SOURCE, None)
    hf = json.loads((folder / "config.json").read_text())
    for method, found, _ in _READERS:
        if found(hf):
            return CheckpointKind(PUBLISHED, PUBLISHED_WEIGHT_PATH, method)
    return CheckpointKind(SOURCE, None)


@dataclass(frozen=True)
class ServedCheckpoint:
    """The folder a server hands to vLLM, resolved once."""

    folder: Path
    served_name: str
    config: dict  # its config.json, parsed
    kind: CheckpointKind

    def check_published_tensors(self) -> None:
        """A published folder's tensors against its config (CheckpointError naming the first that does not fit);
        nothing for any other kind."""
        for method, _, check in _READERS:
            if method == self.kind.method:
                check(self.folder, self.config)
