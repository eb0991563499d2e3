"""Digests of the compile cache: an altered or cut-short file is caught before vLLM loads it.

vLLM loads its AOT artifact (`torch_compile_cache/torch_aot_compile/<hash>/rank_R_D/model`, a
pickle) and Inductor's kernels (`<hash>/inductor_cache/**.so`) trusting their bytes. A file cut
to nothing fails to load and is recompiled, but a flipped byte may load and then run wrong code
or kill the engine, and a damaged kernel is found again under its name by the recompile.

So once an engine is ready, `serve` records the size and sha256 of every file under each <hash>
folder this run loaded or compiled (`spark_edge_digests.json` in that folder). Before vLLM loads
an artifact, the process loading it checks them (fixes.py): if any file differs, that file and
the artifact are deleted, so vLLM compiles anew (counted as a compile-cache miss, reason
"altered") and Inductor, finding no kernel under that name, rebuilds it. A folder without
digests (from before this check) is left to vLLM's own load checks.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from spark_edge.checkpoints.fingerprint import file_sha256

_LOG = logging.getLogger("vllm.spark_edge.cache_digests")

DIGESTS_FILE = "spark_edge_digests.json"
FORMAT = "spark-edge-compile-digests/1"


def hash_dir_of(artifact: Path) -> Path:
    """`.../torch_aot_compile/<hash>/rank_0_0/model` -> `.../torch_aot_compile/<hash>`."""
    return artifact.parent.parent


def _tracked(hash_dir: Path) -> list[Path]:
    """Every file that decides what runs: not our digests, nor Inductor's lock files, nor temporaries."""
    return sorted(
        p
        for p in hash_dir.rglob("*")
        if p.is_file()
        and not p.is_symlink()
        and p.name != DIGESTS_FILE
        and p.suffix not in (".lock", ".tmp")
        and "locks" not in p.relative_to(hash_dir).parts
    )


def seal(hash_dir: Path) -> int:
    """Record size and sha256 of every tracked file under `hash_dir`; returns how many."""
    files = {
        str(p.relative_to(hash_dir)): {"size": p.stat().st_size, "sha256": file_sha256(p)} for p in _tracked(hash_dir)
    }
    tmp = hash_dir / f".{DIGESTS_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"format": FORMAT, "files": files}, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, hash_dir / DIGESTS_FILE)  # never a half-written digest that would condemn a good cache
    return len(files)


def seal_used(events: Iterable[dict[str, Any]]) -> list[Path]:
    """Seal the <hash> folders of the artifacts named by this run's compile-cache events.

    Only those: a folder this run did not load may have been damaged since it was last checked,
    and sealing it would bless the damage. Never raises: a cache that cannot be sealed is
    still a working cache.
    """
    sealed = []
    for hash_dir in sorted({hash_dir_of(Path(e["path"])) for e in events if isinstance(e.get("path"), str)}):
        if not hash_dir.is_dir():
            continue
        try:
            seal(hash_dir)
        except OSError as exc:
            _LOG.warning("spark-edge: could not record compile-cache digests in %s: %s", hash_dir, exc)
            continue
        sealed.append(hash_dir)
    return sealed


UNREADABLE = DIGESTS_FILE  # the name damaged_files gives when the digests themselves are damaged


def damaged_files(hash_dir: Path) -> list[tuple[str, str]]:
    """(file, why) for every file under `hash_dir` that differs from its digests; [] if none or no digests."""
    try:
        recorded = json.loads((hash_dir / DIGESTS_FILE).read_text())
        files = recorded.get("files") if recorded.get("format") == FORMAT else None
    except FileNotFoundError:
        return []
    except (OSError, ValueError, AttributeError):
        files = None
    if not isinstance(files, dict):
        return [(UNREADABLE, "unreadable")]
    damaged = []
    for name, meta in files.items():
        path = hash_dir / name
        size = meta.get("size") if isinstance(meta, dict) else None
        if not path.is_file():
            damaged.append((name, "missing"))
        elif path.stat().st_size != size:
            damaged.append((name, f"{path.stat().st_size} bytes, recorded {size}"))
        elif file_sha256(path) != meta.get("sha256"):
            damaged.append((name, "sha256 differs"))
    return damaged


def discard_if_damaged(artifact: Path) -> list[tuple[str, str]]:
    """Before vLLM loads `artifact`: if anything under its <hash> folder differs from the digests,
    delete the damaged files and the artifact, so both are rebuilt (and resealed once ready).
    With unreadable digests nothing under the folder can be trusted: all of it goes.

    Returns what was damaged ([] if nothing, or if the artifact does not exist yet).
    """
    hash_dir = hash_dir_of(artifact)
    if not artifact.is_file():
        return []
    damaged = damaged_files(hash_dir)
    if not damaged:
        return []
    _LOG.warning(
        "spark-edge: compile cache %s does not match its digests (%s); deleting %s so it is rebuilt",
        hash_dir,
        "; ".join(f"{name}: {why}" for name, why in damaged),
        "all of it" if damaged[0][0] == UNREADABLE else "the damaged files and the compiled artifact",
    )
    if damaged[0][0] == UNREADABLE:
        shutil.rmtree(hash_dir, ignore_errors=True)
        (hash_dir / "inductor_cache").mkdir(parents=True, exist_ok=True)  # vLLM made it before loading
        return damaged
    root = hash_dir.resolve()
    for name, _ in damaged:
        target = hash_dir / name
        if target.resolve().is_relative_to(root):  # a digests file naming "../x" deletes nothing outside
            target.unlink(missing_ok=True)
    artifact.unlink(missing_ok=True)
    (hash_dir / DIGESTS_FILE).unlink(missing_ok=True)
    return damaged
