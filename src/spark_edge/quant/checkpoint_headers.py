"""The tensors of a safetensors checkpoint by name, read from the headers only (milliseconds, no data), and
checked one by one: what `serve` refuses before vLLM would stop on a bare assertion inside the engine."""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open

from spark_edge.errors import CheckpointError

Headers = dict[str, tuple[str, tuple[int, ...]]]  # name -> (safetensors dtype, shape)


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
