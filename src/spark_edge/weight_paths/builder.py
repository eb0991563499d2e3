"""Build a servable checkpoint for one weight path, atomically and at most once.

The output is written into a hidden temporary folder beside the target and renamed
into place only when it is complete and its manifest is written, so a crash never
leaves a half-built checkpoint where vLLM would find it.  A target that already holds
a verified build of the same inputs is left alone.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spark_edge import __version__
from spark_edge.checkpoints.fingerprint import files_sha256
from spark_edge.checkpoints.manifest import MANIFEST_NAME, read_manifest, verify_checkpoint, write_manifest
from spark_edge.checkpoints.sources import open_source, source_fingerprint
from spark_edge.errors import CheckpointError
from spark_edge.weight_paths import writers


def builder_code_fingerprint() -> str:
    """A hash of the code that decides a checkpoint's bytes (converters, writers, quantizers).

    Part of a build's recorded inputs: a changed default or quantizer rebuilds the checkpoint
    instead of serving bytes the current code would not write.
    """
    root = Path(__file__).resolve().parent.parent
    files = [p for d in ("checkpoints", "weight_paths", "formats") for p in (root / d).glob("*.py")]
    # the tensor names the writers follow for a model transformers does not build (Spark-X2.5)
    files += [root / "models" / "declared_layout.py", root / "models" / "spark_layout.py"]
    return files_sha256(files, root)[:16]


@dataclass
class BuildResult:
    out: Path
    built: bool  # False: an up-to-date build was already there
    manifest: dict[str, Any]


@contextmanager
def _exclusive(out: Path) -> Iterator[None]:
    """One builder per target at a time (replicas may share a volume)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _remove_leftovers(out: Path) -> None:
    """Temporary folders of builds that died; safe under the lock."""
    for stale in out.parent.glob(f".{out.name}.*-*"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)


def _existing_state(out: Path, inputs: dict[str, Any]) -> str | None:
    """None if `out` is an up-to-date build; else why it must be rebuilt.

    Raises if `out` holds something that is not ours: we never delete a user's files.
    """
    if not out.exists():
        return "absent"
    if not out.is_dir():
        raise CheckpointError(f"{out}: exists and is not a folder; refusing to replace it")
    if not (out / MANIFEST_NAME).exists():
        if any(out.iterdir()):
            raise CheckpointError(
                f"{out}: exists, is not empty and has no {MANIFEST_NAME}; refusing to overwrite "
                "(remove it or choose another --out)"
            )
        return "empty"
    try:
        manifest = read_manifest(out)
        if manifest.get("inputs") != inputs:
            return "built from other inputs"
        verify_checkpoint(out)
    except CheckpointError as exc:
        return f"corrupt: {exc}"
    return None


def _swap_into_place(tmp: Path, out: Path) -> None:
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)


def _inputs(fingerprint: dict[str, Any], weight_path: str, params: dict[str, Any]) -> dict[str, Any]:
    """What a build is made from: its manifest records them, and a build from other inputs is rebuilt."""
    return {
        "source": fingerprint,
        "weight_path": weight_path,
        "params": params,
        "tool": {"name": "spark-edge", "version": __version__, "code": builder_code_fingerprint()},
    }


def is_up_to_date(model: str | Path | None, weight_path: str, out: Path) -> bool:
    """`out` holds a verified build of `model` for `weight_path` with the writer's default options (what
    `serve` builds); raises CheckpointError if `out` holds something that is not a build of ours."""
    out = Path(out).expanduser().absolute()
    return _existing_state(out, _inputs(source_fingerprint(model), weight_path, {})) is None


def build_checkpoint(
    model: str | Path | None,
    weight_path: str,
    out: Path,
    params: dict[str, Any] | None = None,
    log: Callable[[str], None] = lambda msg: None,
) -> BuildResult:
    """Build `model` (None: the default model) for `weight_path` into `out`."""
    path_writers = writers()
    if weight_path not in path_writers:
        raise CheckpointError(f"unknown weight path {weight_path!r} (known: {', '.join(path_writers)})")
    params = dict(params or {})
    out = Path(out).expanduser().absolute()
    source = open_source(model)
    inputs = _inputs(source.fingerprint(), weight_path, params)
    with _exclusive(out):
        _remove_leftovers(out)
        reason = _existing_state(out, inputs)
        if reason is None:
            log(f"{out}: up to date ({weight_path}), nothing to do")
            return BuildResult(out, False, read_manifest(out))
        if reason not in ("absent", "empty"):
            log(f"{out}: rebuilding ({reason})")
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
        tmp.mkdir()
        try:
            extra_config = path_writers[weight_path](source, tmp, params)
            config = {**source.hf_config(), **extra_config}
            (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            source.save_tokenizer(tmp)
            manifest = write_manifest(tmp, inputs)
            if out.exists() and not any(out.iterdir()):
                out.rmdir()
            _swap_into_place(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    log(f"{out}: built {weight_path} from {source.path}")
    return BuildResult(out, True, manifest)
