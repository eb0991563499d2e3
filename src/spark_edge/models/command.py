"""`spark-edge tiny-spark`: write a small Spark-X2.5-shaped checkpoint with random weights."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from spark_edge import exit_codes


@click.command("tiny-spark")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Folder to create (absent or empty).")
@click.option("--layers", type=click.IntRange(1), default=4, show_default=True,
              help="Decoder layers (the pattern is 3 sliding-window layers, then 1 full layer).")
@click.option("--hidden", type=click.IntRange(32), default=256, show_default=True)
@click.option("--intermediate", type=click.IntRange(32), default=512, show_default=True)
@click.option("--vocab", type=click.IntRange(320), default=512, show_default=True)
@click.option("--sliding-window", type=click.IntRange(1), default=512, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
def tiny_spark(out: Path, layers: int, hidden: int, intermediate: int, vocab: int, sliding_window: int,
               seed: int) -> None:
    """A Spark-shaped checkpoint (Spark2_5ForCausalLM) with random weights, for tests and trials.

    Keeps the 1.7B's attention (8 heads, 2 KV heads of dim 256, fused q_k_v_proj, head gate,
    per-layer-type RoPE, tied embeddings); build it for any weight path with `spark-edge build
    --model OUT`.
    """
    from spark_edge.models.tiny_spark import TinySparkShape, make_tiny_spark

    shape = TinySparkShape(layers=layers, hidden=hidden, intermediate=intermediate, vocab=vocab,
                           sliding_window=sliding_window)
    try:
        make_tiny_spark(out, shape, seed)
    except (FileExistsError, ValueError) as exc:
        click.echo(f"spark-edge: error: {exc}", err=True)
        sys.exit(exit_codes.USAGE)
    click.echo(str(out))
