"""Resident weight bytes of a model on each weight path, from its shape alone.

The same arithmetic as the checkpoint formats, so the plan can be made before a
checkpoint is built; a test holds it to the sizes of real builds.
"""

from __future__ import annotations

from spark_edge.planning.model_shape import ModelShape

BF16 = 2


def _w4a16_linear(n: int, k: int, group: int) -> int:
    # nibbles, plus a bf16 scale and a bf16 offset per group
    return n * k // 2 + 2 * BF16 * n * (k // group)


def _w4a8_linear(n: int, k: int, group: int) -> int:
    # GPTQ: int32 qweight (nibbles), a 16-bit scale per group, int32 qzeros (8 per word), int32 g_idx
    return n * k // 2 + BF16 * n * (k // group) + 4 * (k // group) * (n // 8) + 4 * k


def weight_bytes(shape: ModelShape, weight_path: str, group: int) -> int:
    embedding = shape.vocab * shape.hidden
    norms = BF16 * shape.norm_params()
    if weight_path == "bf16":
        linears = sum(BF16 * n * k for n, k in shape.linear_shapes())
        head = 0 if shape.tied_embeddings else BF16 * embedding
        return linears + BF16 * embedding + head + norms
    if weight_path == "w4a16":
        linears = sum(_w4a16_linear(n, k, group) for n, k in shape.linear_shapes())
        # the embedding is quantized once and, when tied, shared with the head
        head = 0 if shape.tied_embeddings else _w4a16_linear(shape.vocab, shape.hidden, group)
        return linears + _w4a16_linear(shape.vocab, shape.hidden, group) + head + norms
    if weight_path == "w4a8":
        linears = sum(_w4a8_linear(n, k, group) for n, k in shape.linear_shapes())
        # bf16 table for lookup plus a separate 4-bit head
        return linears + BF16 * embedding + _w4a8_linear(shape.vocab, shape.hidden, group) + norms
    raise ValueError(f"unknown weight path {weight_path!r}")
