"""The `spark-edge` command."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from spark_edge import __version__, registry
from spark_edge.environment import VLLM_ARGS, apply_forced_isa, environment_problems
from spark_edge.errors import SparkEdgeError
from spark_edge.settings import WEIGHT_PATH_CHOICES, plan_options, serve_options


def _fail(message: str, code: int) -> None:
    click.echo(f"spark-edge: error: {message}", err=True)
    sys.exit(code)


def _log(message: str) -> None:
    click.echo(f"spark-edge: {message}", err=True)


class _SparkEdge(click.Group):
    """The command group: every subcommand's refusals are mapped to their exit codes here, once."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except SparkEdgeError as exc:  # each kind carries the README's exit code (spark_edge.errors)
            _fail(str(exc), exc.exit_code)


@click.group(cls=_SparkEdge, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="spark-edge")
def main() -> None:
    """Serve small LLMs on CPUs with vLLM."""
    if problems := environment_problems():  # before any command reads them: a usage error (exit 2), named
        raise click.UsageError("; ".join(problems))
    apply_forced_isa()  # before anything imports torch


@main.command()
@click.option(
    "--weight-path",
    type=click.Choice(WEIGHT_PATH_CHOICES),
    default="bf16",
    show_default=True,
    help="Weight format to build: "
    + "; ".join(f"{path.name}: {path.summary}" for path in registry.WEIGHT_PATHS.values())
    + ".",
)
@click.option(
    "--model",
    type=click.Path(path_type=Path),
    default=None,
    help="Source: a GGUF file or a Hugging Face folder (default: SmolLM2-135M-Instruct).",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=None,
    help="Output folder (default: under $SPARK_EDGE_HOME/checkpoints).",
)
@click.option(
    "--group-size",
    type=click.IntRange(8),
    default=None,
    help="4-bit paths: inputs per scale group (w4a16 default 32; w4a8 default the largest of "
    "128/64/32 dividing every K).",
)
@click.option(
    "--search/--no-search",
    default=None,
    help="4-bit paths: per-group scale search (w4a16 default on; w4a8 default off: on the default "
    "model its squared-error search clips the values that matter most).",
)
@click.option("--keep-embedding", is_flag=True, help="w4a16: keep the embedding / tied head in bf16.")
@click.option(
    "--embedding-bits",
    type=click.Choice(["4", "8"]),
    default=None,
    help="w4a16: bits of the quantized embedding / tied head (default 8: per-row int8, oneDNN's int8 GEMM; "
    "4: group-wise like the linears, smaller and less faithful).",
)
def build(
    weight_path: str,
    model: Path | None,
    out: Path | None,
    group_size: int | None,
    search: bool | None,
    keep_embedding: bool,
    embedding_bits: str | None,
) -> None:
    """Build a servable Hugging Face checkpoint for one weight path."""
    from spark_edge.checkpoints.sources import model_id
    from spark_edge.paths import checkpoint_dir
    from spark_edge.weight_paths.builder import build_checkpoint

    params = build_params(weight_path, group_size, search, keep_embedding, embedding_bits)
    target = out or checkpoint_dir(model_id(model), weight_path)
    click.echo(str(build_checkpoint(model, weight_path, target, params, log=_log).out))


def build_params(
    weight_path: str, group_size: int | None, search: bool | None, keep_embedding: bool, embedding_bits: str | None
) -> dict:
    """Only the options a path understands, and only when given: defaults stay the writer's."""
    if weight_path == "bf16":
        if group_size or search is not None or keep_embedding or embedding_bits:
            raise click.UsageError(
                "--group-size, --search/--no-search, --keep-embedding and --embedding-bits apply to 4-bit paths"
            )
        return {}
    if (keep_embedding or embedding_bits) and weight_path != "w4a16":
        raise click.UsageError("--keep-embedding and --embedding-bits apply to w4a16 (w4a8 keeps a bf16 table already)")
    if keep_embedding and embedding_bits:
        raise click.UsageError("--keep-embedding keeps the table in bf16: --embedding-bits does not apply")
    params: dict = {}
    if group_size:
        params["group_size"] = group_size
    if search is not None:
        params["search"] = search
    if keep_embedding:
        params["keep_embedding"] = True
    if embedding_bits:
        params["embedding_bits"] = int(embedding_bits)
    return params


def _run_server(serve_mode: bool, vllm_args: tuple[str, ...], **kwargs) -> None:
    from spark_edge.serving.fast_start import hold_off_full_collections

    hold_off_full_collections()  # before torch and vLLM are imported: until the engine is ready
    from spark_edge.serving.passthrough import vllm_args_from
    from spark_edge.serving.serve import ServeRequest, run

    run(ServeRequest(**kwargs, vllm_args=vllm_args_from(dict(os.environ), vllm_args)), log=_log, serve=serve_mode)


_PASS_THROUGH_HELP = (
    f"\n\nvLLM's own server options follow `--` (and ${VLLM_ARGS.name}, shell words, before them); "
    "`-- --help` lists them. What spark-edge decides (context, KV size, sequences, prefill chunk, "
    "dtype, quantization, host, port, API key, process layout) is refused there, naming the "
    "option to use instead."
)


@main.command(help="Probe, plan and serve a model through vLLM's OpenAI-compatible API." + _PASS_THROUGH_HELP)
@serve_options
def serve(**kwargs) -> None:
    _run_server(True, **kwargs)


@main.command(
    help="Build the checkpoint and fill the compile cache for `serve` with the same options, then exit."
    + _PASS_THROUGH_HELP
)
@serve_options
def warm(**kwargs) -> None:
    _run_server(False, **kwargs)


@main.command()
@plan_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def plan(
    model: Path | None,
    weight_path: str,
    priority: str,
    max_model_len: int,
    max_num_seqs: int,
    memory_limit: int | None,
    kv_cache_dtype: str,
    process_layout: str,
    speculation: str,
    as_json: bool,
) -> None:
    """Predict load peak and steady anonymous RSS, and the context that fits: the plan `serve` runs with
    (the same options and SPARK_EDGE_* variables)."""
    from spark_edge.planning.memory_plan import PlanRefused
    from spark_edge.planning.serving_plan import model_config, resolve_plan, resolve_weight_path
    from spark_edge.planning.speculation import draft_tokens
    from spark_edge.probe.device import probe_device

    device = probe_device()  # a host or model refused here: the command group's exit codes (spark_edge.errors)
    choice = resolve_weight_path(device, priority, weight_path, model)  # as serve's
    try:
        config = model_config(model)
        asked = (memory_limit, max_model_len, max_num_seqs, process_layout)
        drafts = draft_tokens(speculation)
        result = resolve_plan(device, choice, model, config, *asked, kv_dtype=kv_cache_dtype, draft_tokens=drafts).plan
    except PlanRefused as exc:
        if as_json:
            click.echo(json.dumps({"fits": False, "error": str(exc), **exc.plan.as_dict()}, indent=2))
        raise  # the command group prints it and exits with its code
    click.echo(json.dumps(result.as_dict(), indent=2) if as_json else result.summary())


def _register_subcommands() -> None:
    from spark_edge.bench.command import bench
    from spark_edge.checkpoints.command import synth, tiny_spark
    from spark_edge.probe.command import probe

    main.add_command(probe)
    main.add_command(bench)
    main.add_command(tiny_spark)
    main.add_command(synth)


_register_subcommands()

if __name__ == "__main__":
    main()
