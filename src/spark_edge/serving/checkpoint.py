"""Find or build the checkpoint that `serve` hands to vLLM, verified against its manifest."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from spark_edge.checkpoints.builder import build_checkpoint
from spark_edge.checkpoints.manifest import MANIFEST_NAME, read_manifest, verify_checkpoint
from spark_edge.checkpoints.sources import model_id
from spark_edge.paths import checkpoint_dir


def checkpoint_for_serving(model: Path | None, weight_path: str, log: Callable[[str], None]) -> tuple[Path, str]:
    """Return (checkpoint folder, served model name).

    A folder built by `spark-edge build` is served as it is, after its manifest check;
    anything else (GGUF, plain HF folder, the default) is built into the data folder once.
    """
    if model is not None and (Path(model) / MANIFEST_NAME).is_file():
        manifest = verify_checkpoint(Path(model))
        if manifest["inputs"]["weight_path"] != weight_path:
            log(f"{model} is a {manifest['inputs']['weight_path']} build; serving it as such")
        return Path(model).absolute(), Path(model).name
    mid = model_id(model)
    result = build_checkpoint(model, weight_path, checkpoint_dir(mid, weight_path), log=log)
    return result.out, mid


def built_weight_path(model: Path | None) -> str | None:
    """The weight path a folder `spark-edge build` made was built for (its manifest; checked in full when
    served), or None for anything else."""
    if model is None or not (Path(model) / MANIFEST_NAME).is_file():
        return None
    return str(read_manifest(Path(model))["inputs"]["weight_path"])
