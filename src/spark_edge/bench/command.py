"""`spark-edge bench`: weight paths side by side on one model, in one run."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import click

from spark_edge import weight_paths


def _log(message: str) -> None:
    click.echo(f"bench: {message}", err=True)


@click.command()
@click.option("--model", type=click.Path(path_type=Path), default=None,
              help="Source model (default: SmolLM2-135M-Instruct).")
@click.option("--paths", default="bf16,w4a16", show_default=True,
              help=f"Comma-separated weight paths; the first is the baseline ({', '.join(weight_paths.NAMES)}).")
@click.option("--passes", type=click.IntRange(1), default=2, show_default=True)
@click.option("--reps", type=click.IntRange(1), default=3, show_default=True, help="Requests per measurement (best kept).")
@click.option("--out", type=click.Path(path_type=Path), default=Path("bench-results.json"), show_default=True)
@click.option("--keep-cache", is_flag=True, help="Reuse compile caches from an earlier run (no cold start).")
@click.option("--fidelity/--no-fidelity", default=True, show_default=True,
              help="Also score perplexity and teacher-forced top-1 agreement with the baseline on a license text.")
def bench(model: Path | None, paths: str, passes: int, reps: int, out: Path, keep_cache: bool,
          fidelity: bool) -> None:
    """Decode, prefill, load peak, settled RSS and time to ready, per weight path."""
    from spark_edge.bench.fidelity import text_chunks
    from spark_edge.bench.runner import format_table, run_passes, summarize, write_json
    from spark_edge.checkpoints.builder import build_checkpoint
    from spark_edge.checkpoints.sources import model_id
    from spark_edge.paths import checkpoint_dir, spark_edge_home

    names = [p.strip() for p in paths.split(",") if p.strip()]
    unknown = [n for n in names if n not in weight_paths.NAMES]
    if unknown or not names:
        raise click.UsageError(f"unknown weight paths {unknown} (known: {', '.join(weight_paths.NAMES)})")
    home = spark_edge_home() / "bench"
    if not keep_cache:
        shutil.rmtree(home / "arms", ignore_errors=True)  # the first pass of every arm starts cold
    log_dir = home / "logs" / time.strftime("%Y%m%d-%H%M%S")
    log_dir.mkdir(parents=True)
    arms = {}
    for name in names:
        ckpt = build_checkpoint(model, name, checkpoint_dir(model_id(model), name), log=_log).out
        arms[name] = (ckpt, json.loads((ckpt / "config.json").read_text())["vocab_size"])
    windows = text_chunks(arms[names[0]][0]) if fidelity else None
    results = run_passes(arms, passes, home, log_dir, reps, (), _log, windows)
    summary = summarize(results, baseline=names[0])
    summary["model"] = str(model or "default")
    write_json(summary, out)
    click.echo(format_table(summary))
    click.echo(f"JSON: {out}; server logs: {log_dir}")
