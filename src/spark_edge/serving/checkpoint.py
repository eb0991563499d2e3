"""Find or build the checkpoint that `serve` hands to vLLM, verified against its manifest."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from spark_edge.checkpoints.manifest import verify_checkpoint
from spark_edge.checkpoints.served import (
    BUILD,
    PUBLISHED,
    PUBLISHED_WEIGHT_PATH,
    CheckpointKind,
    ServedCheckpoint,
    checkpoint_kind,
)
from spark_edge.checkpoints.sources import model_id
from spark_edge.errors import CheckpointError, SparkEdgeError
from spark_edge.paths import checkpoint_dir
from spark_edge.weight_paths.builder import is_up_to_date


def checkpoint_for_serving(model: Path | None, weight_path: str, log: Callable[[str], None]) -> ServedCheckpoint:
    """The checkpoint a server of `model` on `weight_path` hands to vLLM.

    A folder built by `spark-edge build` is served as it is, after its manifest check, and so is a published
    4-bit checkpoint (GPTQ, AWQ, compressed-tensors: read at load by cpu_int4_gptq / _awq / _ct); anything else
    (GGUF, plain HF folder, the default) is built into the data folder once.
    """
    kind = checkpoint_kind(model)
    if kind.kind == PUBLISHED:
        if weight_path != PUBLISHED_WEIGHT_PATH:
            log(f"{model} is a published 4-bit checkpoint; serving it as it is on the {PUBLISHED_WEIGHT_PATH} kernels")
        return _served(Path(model).absolute(), Path(model).name, kind)
    if kind.kind == BUILD:
        verify_checkpoint(Path(model))
        if kind.weight_path != weight_path:
            log(f"{model} is a {kind.weight_path} build; serving it as such")
        return _served(Path(model).absolute(), Path(model).name, kind)
    mid = model_id(model)
    out = checkpoint_dir(mid, weight_path).expanduser().absolute()
    if is_up_to_date(model, weight_path, out):
        log(f"{out}: up to date ({weight_path}), nothing to do")
    else:
        build_in_child(model, weight_path, out)
    return _served(out, mid, CheckpointKind(BUILD, weight_path))


def _served(folder: Path, name: str, kind: CheckpointKind) -> ServedCheckpoint:
    return ServedCheckpoint(folder, name, json.loads((folder / "config.json").read_text()), kind)


def build_in_child(model: Path | None, weight_path: str, out: Path) -> None:
    """`spark-edge build` in a process of its own: its heap (a whole source tensor, the quantizer's scratch)
    is returned to the OS when it exits, before vLLM starts in this process, so the memory plan, which does
    not count a build, holds on a first start too. Its log lines go to this process's stderr."""
    argv = [sys.executable, "-m", "spark_edge.cli", "build", "--weight-path", weight_path, "--out", str(out)]
    argv += ["--model", str(model)] if model is not None else []
    code = subprocess.run(argv, stdout=subprocess.DEVNULL).returncode
    if code == CheckpointError.exit_code:
        raise CheckpointError(f"building {out.name} from {model or 'the default model'} was refused (reason above)")
    if code < 0:
        raise SparkEdgeError(f"building {out.name} was stopped by {signal.Signals(-code).name}")
    if code != 0:
        raise SparkEdgeError(f"building {out.name} failed with exit code {code} (the log above says why)")
