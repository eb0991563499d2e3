"""`spark-edge plan`: the memory plan for a model and weight path under this host's ceiling."""

from __future__ import annotations

import json
from pathlib import Path

import click

from spark_edge.settings import plan_options


def model_config(model: Path | None) -> dict:
    """config.json of a built or HF checkpoint, or the config a GGUF converts to."""
    if model is not None and (Path(model) / "config.json").is_file():
        return json.loads((Path(model) / "config.json").read_text())
    from spark_edge.checkpoints.sources import open_source

    return open_source(model).hf_config()


@click.command()
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
    as_json: bool,
) -> None:
    """Predict load peak and steady anonymous RSS, and the context that fits: the plan `serve` runs with
    (the same options and SPARK_EDGE_* variables)."""
    from spark_edge.errors import PlanRefused
    from spark_edge.planning.serving_plan import resolve_plan, resolve_weight_path
    from spark_edge.probe.device import probe_device

    device = probe_device()  # a host or model refused here: the command group's exit codes (spark_edge.errors)
    choice = resolve_weight_path(device, priority, weight_path)  # as serve's
    try:
        config = model_config(model)
        asked = (memory_limit, max_model_len, max_num_seqs, process_layout)
        result = resolve_plan(device, choice, model, config, *asked, kv_dtype=kv_cache_dtype).plan
    except PlanRefused as exc:
        if as_json:
            click.echo(json.dumps({"fits": False, "error": str(exc), **exc.plan.as_dict()}, indent=2))
        raise  # the command group prints it and exits with its code
    click.echo(json.dumps(result.as_dict(), indent=2) if as_json else result.summary())
