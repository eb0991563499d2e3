"""`spark-edge tiny-spark` and `spark-edge synth`: random-weight checkpoints (small ones for tests, real
geometries for sizing and benchmarks)."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("tiny-spark")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Folder to create (absent or empty).")
@click.option(
    "--layers",
    type=click.IntRange(1),
    default=4,
    show_default=True,
    help="Decoder layers (the pattern is 3 sliding-window layers, then 1 full layer).",
)
@click.option("--hidden", type=click.IntRange(32), default=256, show_default=True)
@click.option("--intermediate", type=click.IntRange(32), default=512, show_default=True)
@click.option("--vocab", type=click.IntRange(320), default=512, show_default=True)
@click.option("--sliding-window", type=click.IntRange(1), default=512, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
def tiny_spark(
    out: Path, layers: int, hidden: int, intermediate: int, vocab: int, sliding_window: int, seed: int
) -> None:
    """A Spark-shaped checkpoint (Spark2_5ForCausalLM) with random weights, for tests and trials.

    Keeps the 1.7B's attention (8 heads, 2 KV heads of dim 256, fused q_k_v_proj, head gate,
    per-layer-type RoPE, tied embeddings); build it for any weight path with `spark-edge build
    --model OUT`.
    """
    from spark_edge.models.tiny_spark import TinySparkShape, make_tiny_spark

    shape = TinySparkShape(
        layers=layers, hidden=hidden, intermediate=intermediate, vocab=vocab, sliding_window=sliding_window
    )
    try:
        make_tiny_spark(out, shape, seed)
    except (FileExistsError, ValueError) as exc:
        raise click.UsageError(str(exc)) from None
    click.echo(str(out))


# the names `synth` accepts, without importing torch for --help (tests check they match synth.PRESETS)
SYNTH_PRESETS = (
    "smollm2-1.7b",
    "llama-3.2-1b",
    "qwen2.5-1.5b",
    "qwen3-1.7b",
    "gemma-3-1b",
    "phi-3-mini",
    "spark-x2.5-1.7b",
)


@click.command("synth")
@click.option("--like", type=click.Choice(SYNTH_PRESETS), required=True, help="The model whose geometry to copy.")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Folder to create (absent or empty).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--tiny",
    is_flag=True,
    help="Keep the architecture and attention geometry, shrink the rest "
    "(hidden ~256, 4 layers or one period of a layer pattern, vocabulary 512): for checks against a "
    "reference implementation.",
)
def synth(like: str, out: Path, seed: int, tiny: bool) -> None:
    """A Hugging Face checkpoint with a real model's geometry and random weights (the default model's
    tokenizer), written tensor by tensor: for `plan`, `bench` and `serve` on a box before the weights exist.
    Its text is noise; `serve` says so."""
    from spark_edge.checkpoints.synth import write_synthetic

    try:
        write_synthetic(like, out, seed, small=tiny)
    except FileExistsError as exc:
        raise click.UsageError(str(exc)) from None
    click.echo(str(out))
