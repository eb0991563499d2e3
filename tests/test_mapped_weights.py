"""The loaded model's weights over a file's mapping (runtime/mapped_weights.py), without an engine: a module's
large parameters are written once beside a stamped compile cache, then replaced by file-backed views that hold
the same values; small ones stay; outside serve (no stamped cache root) nothing happens."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from spark_edge.runtime.compile_cache import STAMP_FILE
from spark_edge.runtime.mapped_weights import MAPPED_DIR, checkpoint_key, map_model_weights


def _rss(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) << 10


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(4096, 1024).to(torch.bfloat16), requires_grad=False)
        self.packed = torch.nn.Parameter(torch.randint(0, 255, (2048, 2048), dtype=torch.uint8), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.ones(1024), requires_grad=False)  # small: stays
        self.head = torch.nn.Linear(1, 1)
        self.head.weight = self.table  # tied: one object, mapped once


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"x" * 100)
    return folder


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stamped compile cache root, as serve makes one: where mapped weights are written."""
    root = tmp_path / "vllm-cache" / "w4a16"
    root.mkdir(parents=True)
    (root / STAMP_FILE).write_text(json.dumps({"weight_path": "w4a16"}))
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(root))
    return root


def test_large_parameters_are_mapped_with_the_same_values(checkpoint: Path, root: Path) -> None:
    model = _Model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    mapped = map_model_weights(model, checkpoint)
    assert mapped == model.table.nbytes + model.packed.nbytes
    (path,) = (root / MAPPED_DIR).iterdir()
    assert path.name == f"{checkpoint_key(checkpoint)}.safetensors"
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert model.head.weight is model.table
    # a second model of the same checkpoint maps the file as it is (never written twice)
    mtime = path.stat().st_mtime_ns
    again = _Model()
    file_before = _rss("RssFile")
    assert map_model_weights(again, checkpoint) == mapped
    assert path.stat().st_mtime_ns == mtime
    assert torch.equal(again.packed, model.packed) and torch.equal(again.table, model.table)
    again.packed.sum()  # read every page: they count as file-backed RSS, not anonymous
    assert _rss("RssFile") - file_before >= again.packed.nbytes // 2


def test_a_rebuilt_checkpoint_gets_a_file_of_its_own_and_the_old_one_goes(
    checkpoint: Path, root: Path, tmp_path: Path
) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    assert map_model_weights(_Model(), other) > 0  # another checkpoint's file stays
    key = checkpoint_key(checkpoint)
    assert map_model_weights(_Model(), checkpoint) > 0
    (checkpoint / "model.safetensors").write_bytes(b"y" * 101)
    assert checkpoint_key(checkpoint) != key
    assert map_model_weights(_Model(), checkpoint) > 0
    names = {p.name for p in (root / MAPPED_DIR).iterdir()}
    assert names == {f"{checkpoint_key(checkpoint)}.safetensors", f"{checkpoint_key(other)}.safetensors"}


def test_a_file_cut_short_is_written_again(checkpoint: Path, root: Path) -> None:
    mapped = map_model_weights(_Model(), checkpoint)
    (path,) = (root / MAPPED_DIR).iterdir()
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    model = _Model()
    packed = model.packed.detach().clone()
    assert map_model_weights(model, checkpoint) == mapped
    assert torch.equal(model.packed, packed)
    assert path.stat().st_size > mapped


def test_outside_serve_nothing_is_mapped(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    model = _Model()
    assert map_model_weights(model, checkpoint) == 0


def test_an_images_baked_file_is_mapped_where_its_stamp_is_the_live_one(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docker/bake.sh leaves the warm-up's file beside the baked cache: containers map it, read-only, and write
    nothing; a baked file made under another stamp (another CPU) is not used."""
    stamp = json.dumps({"weight_path": "w4a16", "isa_features": ["avx512f"]})
    baked, live = tmp_path / "baked", tmp_path / "home" / "vllm-cache" / "w4a16"
    for root in (baked / "vllm-cache" / "w4a16", live):
        root.mkdir(parents=True)
        (root / STAMP_FILE).write_text(stamp)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(live))
    monkeypatch.delenv("SPARK_EDGE_BAKED_CACHE", raising=False)
    assert map_model_weights(_Model(), checkpoint) > 0  # as at the image's build: written into the live root
    (baked / MAPPED_DIR).mkdir()
    (live / MAPPED_DIR).rename(baked / MAPPED_DIR / "w4a16")
    monkeypatch.setenv("SPARK_EDGE_BAKED_CACHE", str(baked))
    assert map_model_weights(_Model(), checkpoint) > 0
    assert not (live / MAPPED_DIR).exists()  # mapped from the image, nothing written
    (baked / "vllm-cache" / "w4a16" / STAMP_FILE).write_text(json.dumps({"weight_path": "w4a16"}))
    assert map_model_weights(_Model(), checkpoint) > 0
    assert (live / MAPPED_DIR).is_dir()  # another stamp: its own file, in the data folder
