"""vLLM's options after `--` and in $SPARK_EDGE_VLLM_ARGS: read by vLLM's own parser, what spark-edge decides
refused before anything is built or loaded (exit 2, naming the option to use), unreadable TLS files exit 3."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

from spark_edge import exit_codes
from spark_edge.errors import InputFileError
from spark_edge.serving.passthrough import check_pass_through, describe, vllm_args_from
from spark_edge.serving.process_layout import DEFAULT_LAYOUT, layout_env

DECIDED = layout_env(DEFAULT_LAYOUT)


@pytest.mark.parametrize(
    "args, names",
    [
        (("--max-model-len", "4096"), ("--max-model-len", "spark-edge serve --max-model-len")),
        (("--max_num_seqs=8",), ("--max-num-seqs", "spark-edge serve --max-num-seqs")),  # vLLM's underscores
        (("--max-num-batched-tokens", "8192"), ("--max-num-batched-tokens", "--memory-limit")),
        (("--kv-cache-memory-bytes", "1000000"), ("--kv-cache-memory-bytes", "--memory-limit")),
        (("--kv-cache-dtype", "fp8"), ("--kv-cache-dtype", "use spark-edge serve --kv-cache-dtype")),
        (("-q", "awq"), ("--quantization", "--weight-path")),
        (("--speculative-config", '{"method":"ngram"}'), ("--speculative-config", "--speculation")),
        (("--dtype", "bfloat16"), ("--dtype", "--weight-path")),  # even the value spark-edge would pass
        (("--port", "9000"), ("--port", "spark-edge serve --port")),
        (("--api-key", "k"), ("--api-key", "--api-key-file")),
        (("-tp", "2"), ("--tensor-parallel-size", "one engine")),
        (("some/model",), ("a positional model", "spark-edge serve --model")),
        (("--model", "some/model"), ("--model", "spark-edge serve --model")),
    ],
)
def test_what_spark_edge_decides_is_refused_naming_the_option_to_use(
    args: tuple[str, ...], names: tuple[str, ...]
) -> None:
    with pytest.raises(click.UsageError) as refused:
        check_pass_through(args, {}, DECIDED)
    for name in names:
        assert name in refused.value.message, refused.value.message


def test_an_unknown_option_gets_vllms_own_message() -> None:
    with pytest.raises(click.UsageError, match="unrecognized arguments: --no-such-option"):
        check_pass_through(("--no-such-option",), {}, DECIDED)


def test_the_rest_goes_through(tmp_path: Path) -> None:
    check_pass_through(
        (
            "--served-model-name",
            "a",
            "b",
            "--enable-prefix-caching",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            "--structured-outputs-config.backend",
            "xgrammar",
        ),
        {},
        DECIDED,
    )


def test_the_environment_may_not_overrule_the_plan_or_the_layout() -> None:
    with pytest.raises(click.UsageError, match="VLLM_CPU_KVCACHE_SPACE=4.*--memory-limit"):
        check_pass_through((), {"VLLM_CPU_KVCACHE_SPACE": "4"}, DECIDED)
    with pytest.raises(click.UsageError, match="VLLM_ENABLE_V1_MULTIPROCESSING=1.*--process-layout"):
        check_pass_through((), {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, DECIDED)
    check_pass_through((), {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": ""}, DECIDED)


def test_the_variable_comes_first_as_shell_words() -> None:
    env = {"SPARK_EDGE_VLLM_ARGS": "--chat-template '{{ messages }} x' --enable-prefix-caching"}
    assert vllm_args_from(env, ("--served-model-name", "m")) == (
        "--chat-template",
        "{{ messages }} x",
        "--enable-prefix-caching",
        "--served-model-name",
        "m",
    )
    with pytest.raises(click.UsageError, match="SPARK_EDGE_VLLM_ARGS"):
        vllm_args_from({"SPARK_EDGE_VLLM_ARGS": "--chat-template 'unclosed"}, ())


def test_the_start_log_line_names_vllm_variables_but_never_a_key() -> None:
    line = describe(
        ("--served-model-name", "m"),
        {"VLLM_LOGGING_LEVEL": "DEBUG", "VLLM_API_KEY": "secret", "VLLM_CACHE_ROOT": "/x", "PATH": "/bin"},
        {"VLLM_CACHE_ROOT"},
    )
    assert line == (
        "vLLM options passed through: --served-model-name m | vLLM environment passed through: VLLM_LOGGING_LEVEL=DEBUG"
    )
    assert describe((), {}, set()) is None


def test_tls_files_are_checked_before_loading(tmp_path: Path) -> None:
    with pytest.raises(InputFileError, match="--ssl-keyfile .*missing.pem: no such readable file"):
        check_pass_through(("--ssl-keyfile", str(tmp_path / "missing.pem")), {}, DECIDED)
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(InputFileError, match="not a certificate and its private key"):
        check_pass_through(("--ssl-certfile", str(junk), "--ssl-keyfile", str(junk)), {}, DECIDED)


def _serve(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "SPARK_EDGE_HOME": str(tmp_path / "home")}
    return subprocess.run(
        [sys.executable, "-m", "spark_edge.cli", "serve", "--weight-path", "bf16", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_serve_refuses_before_building_anything(tmp_path: Path) -> None:
    result = _serve(tmp_path, "--", "--max-model-len", "4096")
    assert result.returncode == exit_codes.USAGE, result.stderr[-2000:]
    assert "vLLM option --max-model-len: spark-edge's memory plan sizes it" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "home" / "checkpoints").exists()  # refused before the checkpoint step


def test_serve_refuses_an_unreadable_tls_key_with_exit_3(tmp_path: Path) -> None:
    result = _serve(tmp_path, "--", "--ssl-keyfile", "/nonexistent/key.pem", "--ssl-certfile", "/nonexistent/c.pem")
    assert result.returncode == exit_codes.CHECKPOINT, result.stderr[-2000:]
    assert "--ssl-keyfile /nonexistent/key.pem: no such readable file" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "home" / "checkpoints").exists()
