"""`spark-edge plan`: the memory plan for a model and weight path under this host's ceiling."""

from __future__ import annotations

import json
from pathlib import Path

import click

from spark_edge import weight_paths
from spark_edge.planning.memory_plan import DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_NUM_SEQS
from spark_edge.serving.process_layout import DEFAULT_LAYOUT, LAYOUTS


def model_config(model: Path | None) -> dict:
    """config.json of a built or HF checkpoint, or the config a GGUF converts to."""
    if model is not None and (Path(model) / "config.json").is_file():
        return json.loads((Path(model) / "config.json").read_text())
    from spark_edge.checkpoints.sources import open_source

    return open_source(model).hf_config()


@click.command()
@click.option("--model", type=click.Path(path_type=Path), default=None, help="Default: SmolLM2-135M-Instruct.")
@click.option("--weight-path", type=click.Choice(list(weight_paths.NAMES)), default=None,
              help="Default: what a folder `spark-edge build` made was built for, else what `spark-edge probe` "
                   "picks for this host.")
@click.option("--priority", type=click.Choice(["speed", "fidelity"]), default="speed", show_default=True,
              help="As `spark-edge serve --priority`, for the probe's pick.")
@click.option("--max-model-len", type=click.IntRange(16), default=DEFAULT_MAX_MODEL_LEN, show_default=True)
@click.option("--max-num-seqs", type=click.IntRange(1), default=DEFAULT_MAX_NUM_SEQS, show_default=True)
@click.option("--memory-limit", type=click.IntRange(1), default=None,
              help="Ceiling in bytes (default: as `serve` finds it: what the probe finds free under the cgroup "
                   "limit or in host memory, plus what this process holds).")
@click.option("--process-layout", type=click.Choice(LAYOUTS), default=DEFAULT_LAYOUT, show_default=True,
              help="As `spark-edge serve --process-layout`: vLLM's worker process costs its own runtime baseline.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def plan(model: Path | None, weight_path: str | None, priority: str, max_model_len: int, max_num_seqs: int,
         memory_limit: int | None, process_layout: str, as_json: bool) -> None:
    """Predict load peak and steady anonymous RSS, and the context that fits: the plan `serve` runs with."""
    from spark_edge.planning.ceiling import serving_ceiling
    from spark_edge.errors import PlanRefused
    from spark_edge.planning.serving_plan import serving_plan
    from spark_edge.probe.device import probe_device
    from spark_edge.probe.weight_path_choice import select_weight_path
    from spark_edge.serving.checkpoint import built_weight_path

    device = probe_device()  # a host or model refused here: the command group's exit codes (spark_edge.errors)
    choice = select_weight_path(device, priority, weight_path)  # as serve: refuses a host that cannot run it
    path = built_weight_path(model) or choice.name
    config = model_config(model)
    ceiling = serving_ceiling(device.memory, memory_limit)
    try:
        result = serving_plan(device, config, path, ceiling, max_model_len, max_num_seqs, process_layout)
    except PlanRefused as exc:
        if as_json:
            click.echo(json.dumps({"fits": False, "error": str(exc), **exc.plan.as_dict()}, indent=2))
        raise  # the command group prints it and exits with its code
    click.echo(json.dumps(result.as_dict(), indent=2) if as_json else result.summary())
