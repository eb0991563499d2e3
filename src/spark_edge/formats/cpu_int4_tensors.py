"""A cpu_int4 checkpoint's tensors checked against its quantization_config before vLLM loads it.

vLLM's weight loader would stop on a mismatch with a bare assertion deep in the engine process (and a
shape it does accept, such as a group size the scales do not match, would reach the kernels). Reading
the safetensors headers costs milliseconds, so `serve` checks every quantized tensor first and refuses
with the tensor's name (exit 3).
"""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open

from spark_edge.errors import CheckpointError
from spark_edge.formats.cpu_int4_config import QUANT_METHOD, CpuInt4Settings

PACKED, SCALE, ZERO = "weight_packed", "weight_scale", "weight_zero"
INT8 = "weight_int8"  # the 8-bit vocabulary table's codes [N, K]; its SCALE is [N]


def _shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except Exception as exc:  # safetensors raises its own error types for a damaged header
            raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from None
    return shapes


def check_cpu_int4_tensors(folder: Path, config: dict) -> None:
    """Raise CheckpointError naming the first quantized tensor whose shape does not fit the config."""
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") != QUANT_METHOD:
        return
    try:
        group = CpuInt4Settings.from_hf(quant).group_size
    except ValueError as exc:
        raise CheckpointError(f"{folder / 'config.json'}: {exc}") from None
    shapes = _shapes(folder)
    prefixes = [name[: -len(PACKED)] for name in shapes if name.endswith(PACKED)]
    if not prefixes:
        raise CheckpointError(f"{folder}: quantization_config says {QUANT_METHOD}, but no tensor is *.{PACKED}")
    for prefix in (name[: -len(INT8)] for name in shapes if name.endswith(INT8)):
        _check_int8_table(folder, prefix, shapes)
    for prefix in prefixes:
        packed = shapes[prefix + PACKED]
        if len(packed) != 2 or packed[0] % 16:
            raise CheckpointError(
                f"{folder}: {prefix}{PACKED} has shape {list(packed)}; {QUANT_METHOD} needs "
                f"[N, K/2] with N a multiple of 16"
            )
        n, k = packed[0], packed[1] * 2
        if k % group:
            raise CheckpointError(
                f"{folder}: {prefix}{PACKED} holds K={k} weights per row, not a multiple of "
                f"the config's group size {group}"
            )
        for name in (SCALE, ZERO):
            got = shapes.get(prefix + name)
            if got != (n, k // group):
                raise CheckpointError(
                    f"{folder}: {prefix}{name} has shape {list(got) if got else 'none'}, "
                    f"expected [{n}, {k // group}] for {prefix}{PACKED} {list(packed)} at "
                    f"group size {group}"
                )


def _check_int8_table(folder: Path, prefix: str, shapes: dict[str, tuple[int, ...]]) -> None:
    codes, scale = shapes[prefix + INT8], shapes.get(prefix + SCALE)
    if len(codes) != 2 or scale != (codes[0],):
        raise CheckpointError(
            f"{folder}: {prefix}{INT8} has shape {list(codes)} and {prefix}{SCALE} "
            f"{list(scale) if scale else 'none'}; an 8-bit table is [N, K] codes with [N] scales"
        )
