"""Write safetensors files one tensor at a time.

The safetensors header lists every tensor's offset, so it must be known before the
first byte of data.  We get it from a plan (name, dtype, shape) computed up front from
the source's metadata; then tensors arrive one by one, are checked against the plan,
written and dropped.  Peak memory is one tensor, never the whole model; a source that can
make a tensor a block of rows at a time (RowChunks) keeps even that out of memory.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

# safetensors dtype names, and their sizes in bytes
_DTYPES: dict[torch.dtype, tuple[str, int]] = {
    torch.bfloat16: ("BF16", 2),
    torch.float16: ("F16", 2),
    torch.float32: ("F32", 4),
    torch.uint8: ("U8", 1),
    torch.int8: ("I8", 1),
    torch.int32: ("I32", 4),
    torch.int64: ("I64", 8),
}

INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _DTYPES[self.dtype][1]


@dataclass
class RowChunks:
    """A tensor given as consecutive blocks of rows along its first dimension, written as they come."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: Iterator[torch.Tensor]


def _shard(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    shards: list[list[TensorSpec]] = [[]]
    used = 0
    for spec in specs:
        if shards[-1] and used + spec.nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(spec)
        used += spec.nbytes
    return shards


def _header(specs: list[TensorSpec]) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        header[spec.name] = {
            "dtype": _DTYPES[spec.dtype][0],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def _check(spec: TensorSpec, name: str, tensor: torch.Tensor | RowChunks) -> None:
    if name != spec.name or tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
        raise ValueError(
            f"tensor {name} {tuple(tensor.shape)} {tensor.dtype} does not match the planned "
            f"{spec.name} {spec.shape} {spec.dtype}"
        )


def _bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.detach().contiguous().view(torch.uint8).reshape(-1).numpy())


def _write_chunks(f: BinaryIO, spec: TensorSpec, tensor: RowChunks) -> None:
    rows = 0
    for chunk in tensor.chunks:
        if chunk.dtype != spec.dtype or tuple(chunk.shape[1:]) != spec.shape[1:]:
            raise ValueError(
                f"tensor {spec.name}: a block {tuple(chunk.shape)} {chunk.dtype} does not fit {spec.shape} {spec.dtype}"
            )
        rows += chunk.shape[0]
        if rows > spec.shape[0]:
            break
        f.write(_bytes(chunk))
    if rows != spec.shape[0]:
        raise ValueError(f"tensor {spec.name}: its blocks hold {rows} rows, {spec.shape[0]} planned")


def write_safetensors(
    out_dir: Path,
    specs: list[TensorSpec],
    tensors: Iterable[tuple[str, torch.Tensor | RowChunks]],
    max_shard_bytes: int = 4 << 30,
) -> list[str]:
    """Write `tensors` (in the order of `specs`) into shards in `out_dir`; return the file names."""
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError("duplicate tensor names in the plan")
    shards = _shard(specs, max_shard_bytes)
    single = len(shards) == 1
    stream: Iterator[tuple[str, torch.Tensor]] = iter(tensors)
    written: list[str] = []
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = "model.safetensors" if single else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        with open(out_dir / fname, "wb") as f:
            f.write(_header(shard))
            for spec in shard:
                try:
                    name, tensor = next(stream)
                except StopIteration:
                    raise ValueError(f"the source ran out of tensors before {spec.name}") from None
                _check(spec, name, tensor)
                if isinstance(tensor, RowChunks):
                    _write_chunks(f, spec, tensor)
                else:
                    f.write(_bytes(tensor))
                weight_map[spec.name] = fname
        written.append(fname)
    if next(stream, None) is not None:
        raise ValueError("the source produced more tensors than planned")
    if not single:
        index = {"metadata": {"total_size": sum(s.nbytes for s in specs)}, "weight_map": weight_map}
        (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2))
        written.append(INDEX_NAME)
    return written
