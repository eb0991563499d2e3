"""vLLM's own server options and environment, passed through `spark-edge serve [options] -- [vLLM options]`.

Everything reaches vLLM unchanged except what spark-edge decides itself: the memory plan (context, KV
size, sequences, prefill chunk), the weight path (dtype, quantization), where it listens and its key,
the process layout, and one engine behind one API server. Those are refused before anything loads
(exit 2), naming the spark-edge option to use instead. The options are parsed by vLLM's own parser,
so abbreviations, `--opt=value`, underscores and `--config` files are read exactly as vLLM reads them,
and an option vLLM does not know gets vLLM's own message.
"""

from __future__ import annotations

import argparse
import os
import shlex
import ssl
from pathlib import Path

import click

from spark_edge.environment import VLLM_ARGS
from spark_edge.errors import InputFileError

_MEMORY_PLAN = "spark-edge's memory plan sizes it"
_ONE_ENGINE = "spark-edge runs one engine behind one API server (the memory plan sizes that)"
# vLLM's argument dest -> why spark-edge decides it, and the option to use instead
DECIDED_BY_SPARK_EDGE: dict[str, tuple[str, str]] = {
    "model_tag": ("the model is spark-edge's", "--model"),
    "model": ("the model is spark-edge's", "--model"),
    "max_model_len": (_MEMORY_PLAN, "--max-model-len"),
    "max_num_seqs": (_MEMORY_PLAN, "--max-num-seqs"),
    "max_num_batched_tokens": (_MEMORY_PLAN, "--max-model-len and --memory-limit"),
    "kv_cache_memory_bytes": (_MEMORY_PLAN, "--memory-limit"),
    "gpu_memory_utilization": (_MEMORY_PLAN, "--memory-limit"),
    "num_gpu_blocks_override": (_MEMORY_PLAN, "--memory-limit"),
    "kv_cache_dtype": (_MEMORY_PLAN + " for the KV cache's dtype", "--kv-cache-dtype"),
    "speculative_config": (_MEMORY_PLAN + " with room for the drafts", "--speculation"),
    "dtype": ("the weight path decides it", "--weight-path"),
    "quantization": ("the weight path decides it", "--weight-path"),
    "host": ("spark-edge's health checks use it", "--host"),
    "port": ("spark-edge's health checks use it", "--port"),
    "api_key": ("spark-edge keeps it out of argv", "--api-key or --api-key-file"),
    "shutdown_timeout": ("spark-edge's drain uses it", "--shutdown-timeout"),
    "distributed_executor_backend": ("the process layout decides it", "--process-layout"),
    "tensor_parallel_size": (_ONE_ENGINE, "--process-layout"),
    "pipeline_parallel_size": (_ONE_ENGINE, "--process-layout"),
    "data_parallel_size": (_ONE_ENGINE, "--process-layout"),
    "api_server_count": (_ONE_ENGINE, "--process-layout"),
    "headless": (_ONE_ENGINE, "--process-layout"),
    "grpc": (_ONE_ENGINE, "--process-layout"),
}
# vLLM's environment variables that would overrule the same decisions
ENV_DECIDED_BY_SPARK_EDGE: dict[str, str] = {
    "VLLM_CPU_KVCACHE_SPACE": "--memory-limit",  # vLLM's CPU platform lets it replace --kv-cache-memory-bytes
    "VLLM_ENABLE_V1_MULTIPROCESSING": "--process-layout",
}
_TLS_FILES = ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs")


def describe(args: tuple[str, ...], env: dict[str, str], replaced: set[str]) -> str | None:
    """The start log's line: the options as given, and the VLLM_* variables spark-edge leaves alone."""
    ours = set(ENV_DECIDED_BY_SPARK_EDGE) | replaced | {"VLLM_API_KEY"}  # a key's value is never logged
    environment = [f"{k}={v}" for k, v in sorted(env.items()) if k.startswith("VLLM_") and k not in ours]
    parts = ([f"vLLM options passed through: {shlex.join(args)}"] if args else []) + (
        [f"vLLM environment passed through: {', '.join(environment)}"] if environment else []
    )
    return " | ".join(parts) or None


def vllm_args_from(env: dict[str, str], argv_tail: tuple[str, ...]) -> tuple[str, ...]:
    """$SPARK_EDGE_VLLM_ARGS (shell words) first, then what follows `--` on the command line."""
    try:
        from_env = shlex.split(VLLM_ARGS.get(env) or "")
    except ValueError as exc:
        raise click.UsageError(f"{VLLM_ARGS.name}: {exc}") from None
    return (*from_env, *argv_tail)


def _refuse_env(env: dict[str, str], decided: dict[str, str]) -> None:
    """`decided`: what spark-edge sets itself (the same value in the environment contradicts nothing)."""
    for name, option in ENV_DECIDED_BY_SPARK_EDGE.items():
        if env.get(name, "") not in ("", decided.get(name)):
            raise click.UsageError(
                f"the environment sets {name}={env[name]}, which spark-edge decides: unset it "
                f"and use spark-edge serve {option}"
            )


def _vllm_parser() -> argparse.ArgumentParser:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="spark-edge serve [OPTIONS] --"))

    def error(message: str):  # vLLM's message, without its usage line of every option
        raise click.UsageError(f"vLLM options (after -- or in ${VLLM_ARGS.name}): {message}")

    parser.error = error  # type: ignore[method-assign]
    for action in parser._actions:
        action.default = argparse.SUPPRESS  # the namespace then holds only what was given
    return parser


def given_options(args: tuple[str, ...]) -> dict[str, object]:
    """vLLM's reading of the pass-through: its dest -> value, for the options given only."""
    return vars(_vllm_parser().parse_args(list(args)))


def _option_name(dest: str) -> str:
    return "--" + dest.replace("_", "-") if dest != "model_tag" else "a positional model"


def _refuse_decided(given: dict[str, object]) -> None:
    for dest in given:
        if dest in DECIDED_BY_SPARK_EDGE:
            why, option = DECIDED_BY_SPARK_EDGE[dest]
            raise click.UsageError(f"vLLM option {_option_name(dest)}: {why}; use spark-edge serve {option}")


def _check_tls_files(given: dict[str, object]) -> None:
    """A TLS file that cannot be read is refused now, not after the model has loaded."""
    for dest in _TLS_FILES:
        if dest in given and given[dest] is not None:
            path = Path(str(given[dest]))
            if not path.is_file() or not os.access(path, os.R_OK):
                raise InputFileError(f"{_option_name(dest)} {path}: no such readable file")
    if given.get("ssl_certfile") is not None:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        key = given.get("ssl_keyfile")
        try:
            # an encrypted key gets an empty password, not a terminal prompt: vLLM passes uvicorn none either
            context.load_cert_chain(str(given["ssl_certfile"]), None if key is None else str(key), password=b"")
        except (ssl.SSLError, ValueError) as exc:
            raise InputFileError(
                f"--ssl-certfile {given['ssl_certfile']} / --ssl-keyfile {key}: not a certificate "
                f"and its private key ({exc})"
            ) from None
    elif given.get("ssl_keyfile") is not None:
        raise InputFileError(f"--ssl-keyfile {given['ssl_keyfile']} without --ssl-certfile")


def check_pass_through(args: tuple[str, ...], env: dict[str, str], decided: dict[str, str]) -> None:
    """Refuse what spark-edge decides (exit 2) and unreadable TLS files (exit 3); the rest goes to vLLM.

    Parsing imports vLLM's argument classes: call it once the environment vLLM reads at import is set.
    """
    _refuse_env(env, decided)
    if args:
        given = given_options(args)
        _refuse_decided(given)
        _check_tls_files(given)
