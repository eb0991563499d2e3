"""The tensors of a safetensors checkpoint by name, read from the headers only (milliseconds, no data), and
checked one by one: what `serve` refuses before vLLM would stop on a bare assertion inside the engine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from safetensors import safe_open

from spark_edge.errors import CheckpointError

Headers = dict[str, tuple[str, tuple[int, ...]]]  # name -> (safetensors dtype, shape)
Format = TypeVar("Format")


def read_headers(folder: Path) -> Headers:
    """name -> (safetensors dtype such as "I32", shape) over every *.safetensors file of the folder."""
    found: Headers = {}
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    part = f.get_slice(name)
                    found[name] = (part.get_dtype(), tuple(part.get_shape()))
        except Exception as exc:  # safetensors raises its own error types for a damaged file
            raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from None
    return found


def expect_tensor(folder: Path, headers: Headers, name: str, dtypes: set[str], shape: tuple[int, ...]) -> None:
    """Raise CheckpointError unless tensor `name` is in `headers` (read_headers'), of one of `dtypes`, of `shape`."""
    got = headers.get(name)
    if got is None:
        raise CheckpointError(f"{folder}: {name} is missing")
    dtype, actual = got
    if dtype not in dtypes or actual != shape:
        raise CheckpointError(
            f"{folder}: {name} is {dtype} {list(actual)}, expected {'/'.join(sorted(dtypes))} {list(shape)}"
        )


def packed_layers(
    folder: Path, config: dict[str, Any], parse: Callable[[dict[str, Any]], Format], label: str, packed: str
) -> tuple[Format, Headers, list[tuple[str, tuple[int, ...]]]]:
    """What every published reader checks first: its quantization_config parsed by `parse` (a ValueError becomes a
    CheckpointError saying the `label` checkpoint is not served), and each layer's `packed` tensor (suffix) present
    and int32, 8 codes a word. Returns the format, the headers and (layer prefix, packed shape) in name order."""
    try:
        fmt = parse(config["quantization_config"])
    except ValueError as exc:  # pydantic's ValidationError is one too
        raise CheckpointError(f"{folder / 'config.json'}: {label} checkpoint not served: {exc}") from None
    headers = read_headers(folder)
    prefixes = sorted(name.removesuffix(f".{packed}") for name in headers if name.endswith(f".{packed}"))
    if not prefixes:
        method = config["quantization_config"].get("quant_method")
        raise CheckpointError(f"{folder}: quantization_config says {method}, but no tensor is *.{packed}")
    layers = []
    for prefix in prefixes:
        dtype, shape = headers[f"{prefix}.{packed}"]
        if dtype != "I32" or len(shape) != 2:
            raise CheckpointError(
                f"{folder}: {prefix}.{packed} is {dtype} {list(shape)}, expected 2-D I32 (8 codes a word)"
            )
        layers.append((prefix, shape))
    return fmt, headers, layers
