"""Every setting of `serve` and `warm`, declared once: its flag, environment variable, default and help.

click shows each variable in --help, a bad value in one is the same usage error as the flag's (exit 2, naming
the variable), and the README's table is generated from these declarations (scripts/readme_tables.py).
`plan` takes the ones its plan depends on from here too, variables included, so in a pod's environment it
prints the plan `serve` runs with.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import click

from spark_edge import environment, weight_paths
from spark_edge.planning.kv_dtype import KV_DTYPES
from spark_edge.planning.memory_plan import DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_NUM_SEQS
from spark_edge.planning.speculation import DRAFT_TOKENS, MAX_SPECULATING_SEQS, SPECULATION
from spark_edge.serving.process_layout import DEFAULT_LAYOUT, DEFAULT_STUCK_STEP_S, LAYOUTS
from spark_edge.serving.request_limits import DEFAULT_MAX_REQUEST_BYTES

WEIGHT_PATH_CHOICES = list(weight_paths.NAMES)
# What the memory plan depends on: `spark-edge plan` takes these, `serve` and `warm` all of them
PLAN_SETTINGS = (
    "model",
    "weight_path",
    "priority",
    "max_model_len",
    "max_num_seqs",
    "memory_limit",
    "kv_cache_dtype",
    "process_layout",
    "speculation",
)


def setting(*decls: str, envvar: str, **kwargs) -> Callable:
    """A setting: its environment variable is declared with it and shown in --help."""
    return click.option(*decls, envvar=envvar, show_envvar=True, **kwargs)


SETTINGS: dict[str, Callable] = {
    "model": setting(
        "--model",
        type=click.Path(path_type=Path),
        default=None,
        envvar=environment.MODEL.name,
        help="A GGUF file, a Hugging Face folder, or a folder built by `spark-edge build` "
        "(default: SmolLM2-135M-Instruct; in the images, the checkpoint they carry).",
    ),
    "weight_path": setting(
        "--weight-path",
        type=click.Choice(["auto", *WEIGHT_PATH_CHOICES]),
        default="auto",
        show_default=True,
        envvar=environment.WEIGHT_PATH.name,
        help="auto: what a folder `spark-edge build` made was built for, else the fastest path the bench measured "
        "within the fidelity gate on this host class and model shape (w4a16 where nothing was measured; "
        "`spark-edge probe` tells for the default model).",
    ),
    "priority": setting(
        "--priority",
        type=click.Choice(["speed", "fidelity"]),
        default="speed",
        show_default=True,
        envvar=environment.PRIORITY.name,
        help="fidelity: bf16 activations (w4a16) even where w4a8's int8 ones measured faster within the gate.",
    ),
    "host": setting(
        "--host",
        default="127.0.0.1",
        show_default=True,
        envvar=environment.HOST.name,
        help="Address to listen on (0.0.0.0: every interface; the images use it).",
    ),
    "port": setting(
        "--port",
        type=click.IntRange(1, 65535),
        default=8000,
        show_default=True,
        envvar=environment.PORT.name,
        help="Port to listen on.",
    ),
    "max_model_len": setting(
        "--max-model-len",
        type=click.IntRange(16),
        default=DEFAULT_MAX_MODEL_LEN,
        show_default=True,
        envvar=environment.MAX_MODEL_LEN.name,
        help="Longest prompt plus completion, in tokens (reduced if the memory plan needs it).",
    ),
    "max_num_seqs": setting(
        "--max-num-seqs",
        type=click.IntRange(1),
        default=DEFAULT_MAX_NUM_SEQS,
        show_default=True,
        envvar=environment.MAX_NUM_SEQS.name,
        help="Requests decoded together.",
    ),
    "memory_limit": setting(
        "--memory-limit",
        type=click.IntRange(1),
        default=None,
        envvar=environment.MEMORY_LIMIT.name,
        help="Memory ceiling in bytes (default: the probe's, from host memory and the cgroup limit).",
    ),
    "api_key": setting(
        "--api-key",
        default=None,
        envvar=environment.API_KEY.name,
        help="Require `Authorization: Bearer KEY` on /v1/* (prefer the env var or a key file: "
        "a command line is visible to other users).",
    ),
    "api_key_file": setting(
        "--api-key-file",
        type=click.Path(path_type=Path, dir_okay=False),
        default=None,
        envvar=environment.API_KEY_FILE.name,
        help="Read the API key from this file (first line).",
    ),
    "shutdown_timeout": setting(
        "--shutdown-timeout",
        type=click.IntRange(0),
        default=20,
        show_default=True,
        envvar=environment.SHUTDOWN_TIMEOUT.name,
        help="Seconds in-flight requests get to finish after SIGTERM before they are aborted (0: abort at once).",
    ),
    "max_request_bytes": setting(
        "--max-request-bytes",
        type=click.IntRange(1024),
        default=DEFAULT_MAX_REQUEST_BYTES,
        show_default=True,
        envvar=environment.MAX_REQUEST_BYTES.name,
        help="Largest request body accepted; a larger one gets 413 before it is read.",
    ),
    "kv_cache_dtype": setting(
        "--kv-cache-dtype",
        type=click.Choice(KV_DTYPES),
        default="auto",
        show_default=True,
        envvar=environment.KV_CACHE_DTYPE.name,
        help="The KV cache's dtype. auto: bf16, or fp8 where only fp8 fits the context asked for (said at "
        "start); fp8 halves the KV cache and needs AVX-512 or AMX and a head size that is a multiple of 32.",
    ),
    "speculation": setting(
        "--speculation",
        type=click.Choice(SPECULATION),
        default="off",
        show_default=True,
        envvar=environment.SPECULATION.name,
        help=f"ngram: up to {DRAFT_TOKENS} draft tokens a step looked up in the request's own text (vLLM's "
        f"prompt-lookup speculation) while at most {MAX_SPECULATING_SEQS} requests decode, verified by the model: "
        "the same greedy output, faster where the answer repeats its prompt (extraction, RAG, edits).",
    ),
    "stuck_step_timeout": setting(
        "--stuck-step-timeout",
        type=click.IntRange(0),
        default=DEFAULT_STUCK_STEP_S,
        show_default=True,
        envvar=environment.STUCK_STEP_TIMEOUT.name,
        help="single layout: seconds one engine step may run before the engine counts as stuck and the server "
        "exits 7 (0: never). The longest honest step is a prefill chunk of the largest model on the slowest host.",
    ),
    "process_layout": setting(
        "--process-layout",
        type=click.Choice(LAYOUTS),
        default=DEFAULT_LAYOUT,
        show_default=True,
        envvar=environment.PROCESS_LAYOUT.name,
        help="single: the engine core on a thread of the server's own process (one runtime in memory, "
        "fastest measured); engine: the engine core in a process of its own, vLLM's model worker inside it; "
        "split: vLLM's default, the worker in a third process.",
    ),
}
VLLM_ARGS = click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- VLLM_OPTIONS...]")


def _apply(f: Callable, decorators: list[Callable]) -> Callable:
    for decorator in reversed(decorators):  # the first listed is the first in --help
        f = decorator(f)
    return f


def serve_options(f: Callable) -> Callable:
    """What `serve` and `warm` take: warm must build what serve will run, to the byte."""
    return _apply(f, [*SETTINGS.values(), VLLM_ARGS])


def plan_options(f: Callable) -> Callable:
    return _apply(f, [SETTINGS[name] for name in PLAN_SETTINGS])
