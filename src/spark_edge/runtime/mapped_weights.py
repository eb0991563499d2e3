"""The loaded model's weights over a file's mapping (page cache), not in anonymous memory.

vLLM copies every weight into anonymous memory at load, and the 4-bit paths then repack them into the
layout their kernels read. So once a server's model is loaded and processed (`CPUWorker.load_model`,
before compiling), its large parameters, in the very layout the kernels take, are written once into a
safetensors file beside the compile cache, and every later load maps that file (safetensors' mmap storage,
copy-on-write and never written) in place of the copies. The pages are then file-backed: shared by every
process that maps the same file, and reclaimable by the kernel under pressure instead of an OOM kill.

The file lives in the compile cache root (`$VLLM_CACHE_ROOT/mapped-weights/`), whose stamp names the ISA
features, torch, vLLM and weight path it was made for (runtime/compile_cache.py): a root stamped for
anything else is emptied before vLLM starts, so a layout made for another host is never mapped. Its name
is a hash of the checkpoint folder, then of its files' sizes and modification times: a rebuilt checkpoint
gets a file of its own, and the earlier one of the same folder is removed. safetensors refuses a file cut
short (its header gives every tensor's extent); its bytes are not hashed at each start, which would read
the whole file before serving. Written to a temporary name and renamed, so a start that dies while writing leaves
nothing to map. Only under `spark-edge serve` / `warm` (the cache root carries its stamp); other vLLM
processes (the bench's offline engine, the tests') are left as they are.

An image bakes the file (docker/bake.sh) under `$SPARK_EDGE_BAKED_CACHE/mapped-weights/<path>/`, read-only:
where that file was made under the same stamp as the live cache root, it is mapped from the image, so every
container of the image on a node shares one copy of the weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from spark_edge.checkpoints.safetensors_stream import TensorSpec, write_safetensors
from spark_edge.environment import BAKED_CACHE
from spark_edge.runtime.compile_cache import STAMP_FILE

_LOG = logging.getLogger("vllm.spark_edge.mapped_weights")

MAPPED_DIR = "mapped-weights"
# Parameters smaller than this stay where they are (norms, biases): not worth a mapping each.
MIN_MAPPED_BYTES = 64 << 10
_WRITABLE = (torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.int8, torch.int32, torch.int64)


def mapped_weights_root() -> Path | None:
    """Where mapped weights live for this server, or None outside `spark-edge serve` / `warm`."""
    root = os.environ.get("VLLM_CACHE_ROOT")
    if root is None or not (Path(root) / STAMP_FILE).is_file():
        return None
    return Path(root) / MAPPED_DIR


def baked_mapped_file(root: Path, name: str) -> Path | None:
    """The image's mapped file of this name for this weight path, if made under the live root's stamp."""
    baked = BAKED_CACHE.get()
    if not baked:
        return None
    path_folder = root.parent.name  # the weight path's cache root
    candidate = Path(baked) / MAPPED_DIR / path_folder / name
    baked_stamp = Path(baked) / "vllm-cache" / path_folder / STAMP_FILE
    try:
        same = baked_stamp.read_text() == (root.parent / STAMP_FILE).read_text()
    except OSError:
        return None
    return candidate if same and candidate.is_file() else None


def _folder_key(checkpoint: Path) -> str:
    return hashlib.sha256(str(checkpoint.resolve()).encode()).hexdigest()[:12]


def checkpoint_key(checkpoint: Path) -> str:
    """The checkpoint folder, then its files' sizes and modification times (a rebuild changes them)."""
    files = sorted(p for p in checkpoint.iterdir() if p.suffix in (".safetensors", ".json"))
    ident = [str(checkpoint.resolve()), *[(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]]
    return f"{_folder_key(checkpoint)}-{hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:24]}"


def _remove_superseded(path: Path, checkpoint: Path) -> None:
    """Earlier files of the same checkpoint folder (it was rebuilt since): never mapped again. A server still
    running on one keeps its mapping (the kernel frees the pages when it unmaps)."""
    for old in path.parent.glob(f"{_folder_key(checkpoint)}-*.safetensors"):
        if old != path:
            old.unlink(missing_ok=True)
            _LOG.info("spark-edge: removed the mapped weights of an earlier build: %s", old)


def _large_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """Each parameter once (a tied table is one object), large, dense, contiguous, on the CPU."""
    for name, param in model.named_parameters(remove_duplicate=True):
        t = param.data
        if t.device.type == "cpu" and t.dtype in _WRITABLE and t.is_contiguous() and t.nbytes >= MIN_MAPPED_BYTES:
            yield name, param


def _write(path: Path, params: list[tuple[str, torch.nn.Parameter]]) -> None:
    """One tensor at a time (never a second copy of the model); larger elements first, so every tensor's
    data starts aligned to its element size and maps without a copy."""
    ordered = sorted(params, key=lambda p: -p[1].data.element_size())
    specs = [TensorSpec(name, p.data.dtype, tuple(p.data.shape)) for name, p in ordered]
    tmp = path.parent / f".{path.name}.{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        (written,) = write_safetensors(tmp, specs, ((n, p.data) for n, p in ordered), max_shard_bytes=1 << 62)
        (tmp / written).replace(path)
    finally:
        for leftover in tmp.iterdir():
            leftover.unlink()
        tmp.rmdir()


def map_model_weights(model: torch.nn.Module, checkpoint: Path) -> int:
    """Replace the model's large parameters by views of their mapped file (written first if absent); returns
    the bytes now file-backed. Best effort: a file that cannot be written or read leaves the copies."""
    root = mapped_weights_root()
    params = list(_large_parameters(model))
    if root is None or not params:
        return 0
    path = root / f"{checkpoint_key(checkpoint)}.safetensors"
    if (baked := baked_mapped_file(root, path.name)) is not None:
        path = baked
    from safetensors import SafetensorError

    try:
        if not path.is_file():
            _write_for(path, params, checkpoint)
        try:
            return _map(path, params)
        except (SafetensorError, ValueError) as exc:
            if path.parent != root:
                raise  # an image's file is read-only: serve from the copies
            _LOG.warning("spark-edge: the mapped weights were unreadable (%s), written again: %s", exc, path)
            _write_for(path, params, checkpoint)
            return _map(path, params)
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
        _LOG.warning("spark-edge: the weights stay in anonymous memory (%s: %s)", path, exc)
        return 0


def _write_for(path: Path, params: list[tuple[str, torch.nn.Parameter]], checkpoint: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    _write(path, params)
    _remove_superseded(path, checkpoint)
    _LOG.info("spark-edge: wrote the loaded weights for mapping: %s", path)


def _map(path: Path, params: list[tuple[str, torch.nn.Parameter]]) -> int:
    """Every view checked before any parameter is replaced: a file that does not hold this model leaves it
    as it was."""
    from safetensors import safe_open

    views = []
    with safe_open(str(path), framework="pt") as f:
        names = set(f.keys())
        for name, param in params:
            if name not in names:
                raise ValueError(f"{name} is not in the mapped file")
            tensor = f.get_tensor(name)  # over the file's mapping (safetensors >= 0.4, copy-on-write)
            if tensor.dtype != param.data.dtype or tensor.shape != param.data.shape:
                raise ValueError(f"{name}: the mapped file holds {tuple(tensor.shape)} {tensor.dtype}")
            views.append((param, tensor))
    for param, tensor in views:
        param.data = tensor
    mapped = sum(tensor.nbytes for _, tensor in views)
    _LOG.info("spark-edge: %d MiB of weights mapped from %s", mapped >> 20, path)
    return mapped
