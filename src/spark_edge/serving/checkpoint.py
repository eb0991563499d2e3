"""Find or build the checkpoint that `serve` hands to vLLM, verified against its manifest."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from spark_edge.checkpoints.builder import is_up_to_date
from spark_edge.checkpoints.manifest import MANIFEST_NAME, read_manifest, verify_checkpoint
from spark_edge.checkpoints.sources import model_id
from spark_edge.errors import CheckpointError, SparkEdgeError
from spark_edge.paths import checkpoint_dir
from spark_edge.quant import published_awq, published_ct, published_gptq

# A published 4-bit checkpoint is served on the w4a16 path's kernels (repacked at load, never requantized).
PUBLISHED_WEIGHT_PATH = "w4a16"


def published_format(model: Path | None) -> str | None:
    """The vLLM quantization method that reads a published 4-bit folder as it is (`--quantization`), or None
    for anything else (a spark-edge build, a full-precision source, a GGUF)."""
    config = None if model is None else Path(model) / "config.json"
    if config is None or not config.is_file() or (Path(model) / MANIFEST_NAME).is_file():
        return None
    hf = json.loads(config.read_text())
    for reader, found in (
        (published_gptq.METHOD, published_gptq.published_gptq),
        (published_awq.METHOD, published_awq.published_awq),
        (published_ct.METHOD, published_ct.published_ct),
    ):
        if found(hf):
            return reader
    return None


def checkpoint_for_serving(model: Path | None, weight_path: str, log: Callable[[str], None]) -> tuple[Path, str]:
    """Return (checkpoint folder, served model name).

    A folder built by `spark-edge build` is served as it is, after its manifest check, and so is a published
    4-bit checkpoint (GPTQ, AWQ, compressed-tensors: read at load by cpu_int4_gptq / _awq / _ct); anything else
    (GGUF, plain HF folder, the default) is built into the data folder once.
    """
    if published_format(model):
        if weight_path != PUBLISHED_WEIGHT_PATH:
            log(f"{model} is a published 4-bit checkpoint; serving it as it is on the {PUBLISHED_WEIGHT_PATH} kernels")
        return Path(model).absolute(), Path(model).name
    if model is not None and (Path(model) / MANIFEST_NAME).is_file():
        manifest = verify_checkpoint(Path(model))
        if manifest["inputs"]["weight_path"] != weight_path:
            log(f"{model} is a {manifest['inputs']['weight_path']} build; serving it as such")
        return Path(model).absolute(), Path(model).name
    mid = model_id(model)
    out = checkpoint_dir(mid, weight_path).expanduser().absolute()
    if is_up_to_date(model, weight_path, out):
        log(f"{out}: up to date ({weight_path}), nothing to do")
    else:
        build_in_child(model, weight_path, out)
    return out, mid


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


def built_weight_path(model: Path | None) -> str | None:
    """The weight path a folder `spark-edge build` made was built for (its manifest; checked in full when
    served), that of a published 4-bit checkpoint, or None for anything else."""
    if published_format(model):
        return PUBLISHED_WEIGHT_PATH
    if model is None or not (Path(model) / MANIFEST_NAME).is_file():
        return None
    return str(read_manifest(Path(model))["inputs"]["weight_path"])


def check_published_tensors(folder: Path, config: dict) -> None:
    """A published 4-bit folder's tensors against its config (CheckpointError naming the first that does not fit);
    nothing for anything else: spark-edge's own w4a8 builds are GPTQ too, and vLLM's own method reads them."""
    checks = {
        published_gptq.METHOD: published_gptq.check_gptq_tensors,
        published_awq.METHOD: published_awq.check_awq_tensors,
        published_ct.METHOD: published_ct.check_ct_tensors,
    }
    method = published_format(folder)
    if method:
        checks[method](folder, config)
