"""Every weight path and every container image, recorded once; the modules that need one read it here.

A weight path is how a checkpoint stores its weights and which kernel runs them: its writer (the module
that fills a checkpoint folder), the quantization method vLLM reads from its config.json, what the memory
plan needs of it (the bytes it holds for a model shape, its load transient), the 4-bit group it defaults to
and what the host needs to run it. An image is a Dockerfile built for one ISA around one weight path.

Adding a weight path means an entry in WEIGHT_PATHS and its own writer module (spark_edge/weight_paths/); an
image, an entry in IMAGES and its Dockerfile. Torch-free, so `plan`, `probe` and `--help` stay quick.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from spark_edge.errors import CheckpointError

if TYPE_CHECKING:
    from spark_edge.checkpoints.sources import CheckpointSource


class ModelShape(Protocol):
    """What a weight path's byte count reads of a model's geometry (planning.model_shape.ModelShape is one)."""

    vocab: int
    hidden: int
    tied_embeddings: bool

    def linear_shapes(self) -> list[tuple[int, int]]: ...

    def norm_params(self) -> int: ...


WeightWriter = Callable[["CheckpointSource", "Path", dict[str, Any]], dict[str, Any]]
BF16 = 2


@dataclass(frozen=True)
class WeightPath:
    name: str
    summary: str
    writer: str  # "module:function", imported on use (quantizers pull in torch)
    quantization: str | None  # the method vLLM reads from config.json; None: plain bf16 tensors
    stored_bytes: Callable[[ModelShape, int], int]  # resident weight bytes for a shape and 4-bit group
    # load peak over settled, as a fraction of the weights (the plan's load transient)
    load_transient_fraction: float
    default_group: Callable[[Iterable[int]], int] | None  # the linears' K dims -> group (None: not grouped)
    # machines it runs on, and what to say on another (spark_edge.probe.weight_path_choice asks)
    machines: tuple[str, ...] = ("x86_64", "aarch64")
    elsewhere: str = ""

    def write(self) -> WeightWriter:
        module, function = self.writer.split(":")
        return getattr(importlib.import_module(module), function)


# --- bf16 ---------------------------------------------------------------------------------------------


def _bf16_bytes(shape: ModelShape, group: int) -> int:
    embedding = BF16 * shape.vocab * shape.hidden
    head = 0 if shape.tied_embeddings else embedding
    return sum(BF16 * n * k for n, k in shape.linear_shapes()) + embedding + head + BF16 * shape.norm_params()


# --- w4a16: spark-edge's cpu_int4 ---------------------------------------------------------------------

W4A16_GROUP = 32  # SmolLM2's weights came from Q4_1 (groups of 32): g32 keeps its perplexity near bf16


def _w4a16_linear(n: int, k: int, group: int) -> int:
    return n * k // 2 + 2 * BF16 * n * (k // group)  # nibbles, plus a bf16 scale and a bf16 offset per group


# The vocabulary table's bits on w4a16 (cpu_int4's embedding_bits): 8, per-row int8 codes and a float32 scale
# a row. The head decides every token: on the default model (its source table Q8_0) the w4a16 build scored
# x1.061 bf16's perplexity with a 4-bit table and x1.007 with an 8-bit one (Intel Xeon AMX, bench --fidelity).
W4A16_EMBEDDING_BITS = 8


def _int8_table(vocab: int, hidden: int) -> int:
    return vocab * hidden + 4 * vocab


def _w4a16_bytes(shape: ModelShape, group: int) -> int:
    # the embedding is quantized once and, when tied, shared with the head
    table = _int8_table(shape.vocab, shape.hidden)
    head = 0 if shape.tied_embeddings else table
    return sum(_w4a16_linear(n, k, group) for n, k in shape.linear_shapes()) + table + head + BF16 * shape.norm_params()


# --- w4a8: GPTQ for vLLM's AMX kernel -----------------------------------------------------------------

W4A8_GROUPS = (128, 64, 32)  # what vLLM's GPTQ config accepts (and -1, one group per row, not offered)


def _w4a8_linear(n: int, k: int, group: int) -> int:
    # int32 qweight (nibbles), a 16-bit scale per group, int32 qzeros (8 per word), int32 g_idx
    return n * k // 2 + BF16 * n * (k // group) + 4 * (k // group) * (n // 8) + 4 * k


def _w4a8_bytes(shape: ModelShape, group: int) -> int:
    # a bf16 table for the lookup plus a separate 4-bit head
    linears = sum(_w4a8_linear(n, k, group) for n, k in shape.linear_shapes())
    return (
        linears
        + BF16 * shape.vocab * shape.hidden
        + _w4a8_linear(shape.vocab, shape.hidden, group)
        + BF16 * shape.norm_params()
    )


def w4a8_group(ks: Iterable[int]) -> int:
    """The largest group vLLM's GPTQ method accepts that divides every K."""
    ks = sorted(set(ks))
    for g in W4A8_GROUPS:
        if all(k % g == 0 for k in ks):
            return g
    raise CheckpointError(f"w4a8: no group size of {W4A8_GROUPS} divides every K ({ks})")


WEIGHT_PATHS: dict[str, WeightPath] = {
    p.name: p
    for p in (
        WeightPath(
            "bf16",
            "the source's weights cast to bfloat16, unquantized",
            "spark_edge.weight_paths.bf16:write_bf16",
            None,
            _bf16_bytes,
            0.02,
            None,
        ),
        WeightPath(
            "w4a16",
            "4-bit group-wise weights, bf16 activations (spark-edge's cpu_int4 kernels)",
            "spark_edge.weight_paths.w4a16:write_w4a16",
            "cpu_int4",
            _w4a16_bytes,
            0.02,
            lambda ks: W4A16_GROUP,
        ),
        # vLLM's own repack at load is not measured yet: a conservative half of the weights
        WeightPath(
            "w4a8",
            "symmetric 4-bit GPTQ weights, int8 activations (vLLM's AMX W4A8 kernel)",
            "spark_edge.weight_paths.w4a8:write_w4a8",
            "gptq",
            _w4a8_bytes,
            0.50,
            w4a8_group,
            ("x86_64",),
            "w4a8 is the export for vLLM's x86 AMX kernel (AMX is an x86-64 extension): use --weight-path w4a16",
        ),
    )
}


def weight_path(name: str) -> WeightPath:
    try:
        return WEIGHT_PATHS[name]
    except KeyError:
        raise ValueError(f"unknown weight path {name!r} (known: {', '.join(WEIGHT_PATHS)})") from None


# --- images -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Image:
    isa: str  # the probe's name for the CPU family it targets
    name: str  # of its Dockerfile, make target and tag
    tag: str
    weight_path: str
    needs: str  # what the host must have, said to a user whose host lacks it
    runs_on: tuple[str, ...]  # the host classes (spark_edge.probe.isa.isa_label) it runs on
    arch: str  # the Debian/docker architecture it is built for
    recipe: str | None = None  # a shared recipe built after the image's own Dockerfile (repo-relative)
    # the native int4 library's build target (spark_edge.kernels.native_int4): "" for the build host's CPU, a
    # portable -march level for an image whose hosts are a class of CPUs other than its builder's
    kernel_target: str = ""

    @property
    def dockerfile(self) -> str:
        return f"Dockerfile.{self.name}"


X86_RECIPE = "docker/x86.Dockerfile"  # every x86-64 image is built by one recipe; its Dockerfile says what differs
# In order of preference: the most specific image a host runs is the one recommended.
IMAGES: dict[str, Image] = {
    i.isa: i
    for i in (
        Image(
            "amx",
            "amx",
            "spark-edge:amx",
            # what `auto` picks for the default model on an AMX host (probe/measured_paths.json; a test holds
            # them equal): w4a16 decoded faster than w4a8 there and kept bf16's perplexity far closer
            "w4a16",
            "AMX int8 tiles usable by this process (Sapphire Rapids or newer Xeon)",
            ("amx",),
            "amd64",
            X86_RECIPE,
        ),
        Image(
            "avx512",
            "avx512",
            "spark-edge:avx512",
            "w4a16",
            "AVX-512 (avx512f, avx512bw, avx512dq, avx512vl)",
            ("amx", "avx512"),
            "amd64",
            X86_RECIPE,
        ),
        Image(
            "avx2",
            "avx2",
            "spark-edge:avx2",
            "w4a16",
            "AVX2, FMA and F16C (Intel Haswell, AMD Zen and newer)",
            ("amx", "avx512", "avx2"),
            "amd64",
            X86_RECIPE,
            # built on an AVX-512 machine for CPUs without AVX-512: x86-64-v3, AVX-VNNI chosen at run time
            "x86-64-v3",
        ),
        Image("arm64", "arm", "spark-edge:arm", "w4a16", "an arm64 CPU with NEON (asimd)", ("arm64",), "arm64"),
    )
}


def image(isa: str) -> Image:
    try:
        return IMAGES[isa]
    except KeyError:
        raise ValueError(f"unknown image ISA {isa!r}; known: {', '.join(IMAGES)}") from None
