"""Whether a start will compile, so that the plan counts what compiling costs.

A start whose graph is not in vLLM's compile cache runs Inductor, which compiles C++ kernels with
g++ beside an engine that has already loaded the model. The first of them builds a precompiled
header of torch's kernel prelude: its cc1plus held 431 MiB (AMD EPYC Zen 4 host, default model,
w4a16), and on a first start under the smallest limit the plan then accepted, the engine core was
OOM-killed at that moment. A start that loads its graph from the cache runs no compiler.

vLLM's own cache key is its whole config, which is only known inside vLLM. So once a server (or
`warm`) is ready, the cache root records the key of what it now holds (COMPILED_FILE): the checkpoint
folder, the weight path and what the plan decides (context, sequences, prefill chunk, KV cache dtype),
under the root's stamp (compile_cache.cache_stamp: ISA, torch, vLLM). A start whose key is recorded
under the same stamp plans warm; any other start plans the compiler too. A wrong guess can only be
towards caution: a key not recorded (other vLLM options, a damaged artifact deleted) plans the
compiler even where vLLM would have found its graph.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from spark_edge.paths import spark_edge_home
from spark_edge.planning.memory_plan import MiB

# The C++ compiler beside the engine on a cold start: cc1plus building the precompiled header (431 MiB
# measured, above), with room for the g++ driver and as (a few MiB each).
COMPILER_TRANSIENT_BYTES = 448 * MiB
COMPILED_FILE = "spark_edge_compiled.json"


def compile_cache_root(weight_path: str) -> Path:
    """One cache root per weight path: its stamp names the path, so paths never evict each other."""
    return spark_edge_home() / "vllm-cache" / weight_path


def compile_key(
    checkpoint: str,
    weight_path: str,
    max_model_len: int,
    max_num_seqs: int,
    prefill_chunk: int,
    kv_dtype: str,
    draft_tokens: int = 0,
) -> str:
    """What makes vLLM compile anew, of what spark-edge decides (`checkpoint`: the folder vLLM loads)."""
    parts = [checkpoint, weight_path, max_model_len, max_num_seqs, prefill_chunk, kv_dtype]
    if draft_tokens:  # appended only when on: the keys recorded before speculation existed stay valid
        parts.append(draft_tokens)
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def _read(root: Path) -> dict[str, Any]:
    try:
        record = json.loads((root / COMPILED_FILE).read_text())
        return record if isinstance(record, dict) else {}
    except (OSError, ValueError):
        return {}


def is_compiled(root: Path, stamp: dict[str, Any], key: str) -> bool:
    """The cache root holds the graph of `key`, compiled under `stamp` (a root stamped otherwise is emptied
    before vLLM sees it, runtime/compile_cache.py)."""
    record = _read(root)
    return record.get("stamp") == stamp and key in record.get("keys", [])


def record_compiled(root: Path, stamp: dict[str, Any], key: str) -> None:
    """After ready: the root now holds `key`'s graph. Best effort (a read-only cache stays as it was)."""
    record = _read(root)
    keys = set(record.get("keys", [])) if record.get("stamp") == stamp else set()
    tmp = root / f".{COMPILED_FILE}.{os.getpid()}"
    try:
        tmp.write_text(json.dumps({"stamp": stamp, "keys": sorted(keys | {key})}, sort_keys=True))
        tmp.replace(root / COMPILED_FILE)
    except OSError:
        tmp.unlink(missing_ok=True)
