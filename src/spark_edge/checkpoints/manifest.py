"""The manifest a built checkpoint carries: what it was built from, by what, and every
file's size and sha256, so a truncated or altered file is caught before vLLM loads it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from spark_edge.checkpoints.fingerprint import file_sha256
from spark_edge.errors import CheckpointError

MANIFEST_NAME = "spark_edge_manifest.json"
FORMAT = "spark-edge-checkpoint/1"


def write_manifest(out: Path, inputs: dict[str, Any]) -> dict[str, Any]:
    files = {
        p.name: {"size": p.stat().st_size, "sha256": file_sha256(p)}
        for p in sorted(out.iterdir())
        if p.is_file() and p.name != MANIFEST_NAME
    }
    manifest = {"format": FORMAT, "inputs": inputs, "files": files, "created_unix": int(time.time())}
    (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def read_manifest(out: Path) -> dict[str, Any]:
    path = out / MANIFEST_NAME
    if not path.is_file():
        raise CheckpointError(f"{out}: no {MANIFEST_NAME} (not built by spark-edge, or the build did not finish)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: corrupt manifest ({exc})") from exc
    if manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{path}: unknown manifest format {manifest.get('format')!r}")
    return manifest


def verify_checkpoint(out: Path, full: bool = True) -> dict[str, Any]:
    """Check every listed file against the manifest; raise CheckpointError naming the first problem.

    `full` hashes the contents (catches a flipped byte); otherwise only sizes are compared.
    """
    manifest = read_manifest(out)
    for name, meta in manifest["files"].items():
        path = out / name
        if not path.is_file():
            raise CheckpointError(f"{out}: {name} is missing")
        size = path.stat().st_size
        if size != meta["size"]:
            raise CheckpointError(f"{out}: {name} is {size} bytes, the manifest says {meta['size']} (truncated?)")
        if full and file_sha256(path) != meta["sha256"]:
            raise CheckpointError(f"{out}: {name} does not match its sha256 in the manifest (altered or corrupt)")
    return manifest
