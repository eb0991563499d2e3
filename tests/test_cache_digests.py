"""Compile-cache digests (spark_edge.runtime.cache_digests): a cut-short or altered file in vLLM's
compile cache is caught before it is loaded, deleted, counted as a miss and so rebuilt.

The last tests use a real torch AOT artifact and vLLM's own `_try_load_aot_compiled_fn`: one
flipped byte in an artifact aborts the process that loads it, which for a server is an engine
that dies at every start.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from spark_edge.environment import RUN_DIR
from spark_edge.runtime import cache_digests, fixes
from spark_edge.runtime.cache_digests import DIGESTS_FILE, damaged_files, discard_if_damaged, seal, seal_used
from spark_edge.runtime.compile_cache import HIT, MISS, read_events

HASH = "f80a63ce19af56a982b5f0c7db2f8e2033874f72df4c1f4be455f4d1387d7f30"
# In every artifact (torch's global-state guard, JSON parsed in C++ at load): turning the quote
# after this into '#' makes nlohmann::json throw through C++, and the process aborts.
GUARD_JSON = b'"allow_tf32":false,"autocast_state"'


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    run = tmp_path / "run"
    monkeypatch.setenv(RUN_DIR.name, str(run))
    return run


def _hash_dir(root: Path, artifact_bytes: bytes = b"compiled model") -> Path:
    """Laid out as vLLM lays out one compiled model in its cache."""
    hash_dir = root / "torch_compile_cache" / "torch_aot_compile" / HASH
    (hash_dir / "rank_0_0").mkdir(parents=True)
    (hash_dir / "rank_0_0" / "model").write_bytes(artifact_bytes)
    for sub, name, body in (
        ("ab", "cabc.main.so", b"\x7fELF kernel one"),
        ("cd", "ccd.so", b"\x7fELF kernel two"),
        ("cd", "ccd.cpp", b"// kernel source"),
        ("locks", "cabc.lock", b""),
    ):
        (hash_dir / "inductor_cache" / sub).mkdir(parents=True, exist_ok=True)
        (hash_dir / "inductor_cache" / sub / name).write_bytes(body)
    return hash_dir


def _flip(path: Path, offset: int = 3) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_seal_records_every_file_but_locks_digests_and_temporaries(tmp_path: Path) -> None:
    hash_dir = _hash_dir(tmp_path)
    (hash_dir / "rank_0_0" / "model.123.tmp").write_bytes(b"half written")
    assert seal(hash_dir) == 4
    recorded = json.loads((hash_dir / DIGESTS_FILE).read_text())["files"]
    assert sorted(recorded) == [
        "inductor_cache/ab/cabc.main.so",
        "inductor_cache/cd/ccd.cpp",
        "inductor_cache/cd/ccd.so",
        "rank_0_0/model",
    ]
    assert recorded["rank_0_0/model"]["size"] == len(b"compiled model")
    assert damaged_files(hash_dir) == []
    (hash_dir / "inductor_cache" / "locks" / "new.lock").write_bytes(b"")  # Inductor takes locks at will
    assert damaged_files(hash_dir) == []


@pytest.mark.parametrize(
    "damage, expected",
    [
        (lambda d: (d / "rank_0_0" / "model").write_bytes(b"compiled"), "8 bytes, recorded 14"),
        (lambda d: _flip(d / "rank_0_0" / "model"), "sha256 differs"),
        (lambda d: _flip(d / "inductor_cache" / "ab" / "cabc.main.so"), "sha256 differs"),
        (lambda d: (d / "inductor_cache" / "cd" / "ccd.so").unlink(), "missing"),
    ],
)
def test_a_cut_altered_or_missing_file_is_named(tmp_path: Path, damage: Any, expected: str) -> None:
    hash_dir = _hash_dir(tmp_path)
    seal(hash_dir)
    damage(hash_dir)
    (found,) = damaged_files(hash_dir)
    assert found[1] == expected


def test_discard_deletes_the_damaged_kernel_and_the_artifact_and_keeps_the_rest(tmp_path: Path) -> None:
    hash_dir = _hash_dir(tmp_path)
    seal(hash_dir)
    _flip(hash_dir / "inductor_cache" / "ab" / "cabc.main.so")
    damaged = discard_if_damaged(hash_dir / "rank_0_0" / "model")
    assert damaged == [("inductor_cache/ab/cabc.main.so", "sha256 differs")]
    assert not (hash_dir / "inductor_cache" / "ab" / "cabc.main.so").exists()  # Inductor rebuilds it
    assert not (hash_dir / "rank_0_0" / "model").exists()  # vLLM finds no artifact: it compiles
    assert not (hash_dir / DIGESTS_FILE).exists()  # resealed when the rebuilt engine is ready
    assert (hash_dir / "inductor_cache" / "cd" / "ccd.so").read_bytes() == b"\x7fELF kernel two"


def test_unreadable_digests_discard_the_whole_folder(tmp_path: Path) -> None:
    hash_dir = _hash_dir(tmp_path)
    seal(hash_dir)
    (hash_dir / DIGESTS_FILE).write_text('{"format": "spark-edge-compile-digests/1", "fil')
    assert discard_if_damaged(hash_dir / "rank_0_0" / "model") == [(DIGESTS_FILE, "unreadable")]
    assert [p.name for p in hash_dir.iterdir()] == ["inductor_cache"]  # vLLM made it before loading
    assert not any((hash_dir / "inductor_cache").iterdir())


def test_digests_naming_a_file_outside_the_folder_never_delete_it(tmp_path: Path) -> None:
    hash_dir = _hash_dir(tmp_path / "cache")
    outside = tmp_path / "keep.txt"
    outside.write_text("not ours")
    seal(hash_dir)
    recorded = json.loads((hash_dir / DIGESTS_FILE).read_text())
    recorded["files"]["../../../../keep.txt"] = {"size": 1, "sha256": "0" * 64}
    (hash_dir / DIGESTS_FILE).write_text(json.dumps(recorded))
    assert discard_if_damaged(hash_dir / "rank_0_0" / "model")
    assert outside.read_text() == "not ours"


def test_without_digests_or_artifact_nothing_is_touched(tmp_path: Path) -> None:
    hash_dir = _hash_dir(tmp_path)
    _flip(hash_dir / "rank_0_0" / "model")  # an old cache, never sealed: vLLM's own checks decide
    assert discard_if_damaged(hash_dir / "rank_0_0" / "model") == []
    assert (hash_dir / "rank_0_0" / "model").exists()
    seal(hash_dir)
    (hash_dir / "rank_0_0" / "model").unlink()
    assert discard_if_damaged(hash_dir / "rank_0_0" / "model") == []  # nothing to load: nothing to check
    assert (hash_dir / "inductor_cache" / "cd" / "ccd.so").exists()


def test_only_the_folders_this_run_used_are_sealed(tmp_path: Path) -> None:
    used = _hash_dir(tmp_path / "a")
    unused = _hash_dir(tmp_path / "b")
    events = [
        {"event": MISS, "reason": "no_artifact", "path": str(used / "rank_0_0" / "model")},
        {"event": MISS, "reason": "stamp_mismatch"},  # no path: the stamp check, not a load
        {"event": HIT, "path": str(tmp_path / "gone" / HASH / "rank_0_0" / "model")},
    ]
    assert seal_used(events) == [used]
    assert (used / DIGESTS_FILE).exists() and not (unused / DIGESTS_FILE).exists()


# --- a real artifact through vLLM's loader --------------------------------------------------------


def _double_silu(x: Any) -> Any:
    import torch

    return torch.nn.functional.silu(x) * 2 + 1


@pytest.fixture(scope="module")
def real_artifact(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A real torch AOT artifact of the kind vLLM saves on CPU (aot_eager: the same wrapper, no C++ build)."""
    import torch

    with torch._dynamo.config.patch(enable_aot_compile=True):
        compiled = torch.compile(_double_silu, fullgraph=True, dynamic=False, backend="aot_eager")
        artifact = compiled.aot_compile(((torch.randn(4, 8),), {}))
    path = tmp_path_factory.mktemp("aot") / "model"
    artifact.save_compiled_function(str(path))
    data = path.read_bytes()
    assert GUARD_JSON in data
    return data


def _guard_broken(data: bytes) -> bytes:
    at = data.index(GUARD_JSON) + len(b'"allow_tf32":false,')
    return data[:at] + b"#" + data[at + 1 :]


def test_one_flipped_byte_in_an_artifact_aborts_the_process_loading_it(real_artifact: bytes, tmp_path: Path) -> None:
    """Why the digests exist: no exception for vLLM to catch and recompile after, the process dies."""
    altered = tmp_path / "model"
    altered.write_bytes(_guard_broken(real_artifact))
    load = textwrap.dedent(f"""
        import torch
        with open({str(altered)!r}, "rb") as f:
            torch.compiler.load_compiled_function(f)
        print("LOADED")
    """)
    run = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, timeout=300)
    assert run.returncode < 0 and "LOADED" not in run.stdout, (
        f"torch now survives this artifact (rc {run.returncode}): the digests are a safeguard, no longer a fix"
    )
    assert "parse_error" in run.stderr


@pytest.fixture
def fake_compiled_model() -> SimpleNamespace:
    """What `_try_load_aot_compiled_fn` reads from the model it loads for."""
    from vllm.config import VllmConfig

    config = VllmConfig()
    return SimpleNamespace(
        vllm_config=config, compilation_config=config.compilation_config, _is_encoder=False, forward=_double_silu
    )


def test_an_altered_artifact_is_never_loaded_but_counted_as_a_miss(
    real_artifact: bytes, fake_compiled_model: SimpleNamespace, run_dir: Path, tmp_path: Path
) -> None:
    import torch

    fixes.apply_runtime_fixes()
    from vllm.compilation import decorators

    hash_dir = _hash_dir(tmp_path, real_artifact)
    artifact = hash_dir / "rank_0_0" / "model"
    seal(hash_dir)
    loaded = decorators._try_load_aot_compiled_fn(fake_compiled_model, str(artifact))
    x = torch.randn(4, 8)
    assert loaded is not None and torch.allclose(loaded(x), _double_silu(x))  # sealed and intact: a hit

    artifact.write_bytes(_guard_broken(real_artifact))  # same size: only the sha256 tells
    assert decorators._try_load_aot_compiled_fn(fake_compiled_model, str(artifact)) is None  # alive: not loaded
    assert not artifact.exists() and not (hash_dir / DIGESTS_FILE).exists()
    assert [(e["event"], e.get("reason")) for e in read_events(run_dir)] == [(HIT, None), (MISS, "altered")]


def test_an_artifact_with_bytes_appended_loads_silently_unless_sealed(
    real_artifact: bytes, fake_compiled_model: SimpleNamespace, run_dir: Path, tmp_path: Path
) -> None:
    fixes.apply_runtime_fixes()
    from vllm.compilation import decorators

    unsealed = _hash_dir(tmp_path / "unsealed", real_artifact + b"garbage appended by a bad copy")
    loaded = decorators._try_load_aot_compiled_fn(fake_compiled_model, str(unsealed / "rank_0_0" / "model"))
    assert loaded is not None  # vLLM and torch accept it: pickle stops reading before the garbage

    sealed = _hash_dir(tmp_path / "sealed", real_artifact)
    seal(sealed)
    with open(sealed / "rank_0_0" / "model", "ab") as f:
        f.write(b"garbage appended by a bad copy")
    assert decorators._try_load_aot_compiled_fn(fake_compiled_model, str(sealed / "rank_0_0" / "model")) is None
    assert [e.get("reason") for e in read_events(run_dir)] == [None, "altered"]


def test_a_digest_check_that_cannot_read_does_not_stop_the_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unreadable(artifact: Path) -> list:
        raise PermissionError(13, "Permission denied", str(artifact))

    monkeypatch.setattr(cache_digests, "discard_if_damaged", unreadable)
    assert fixes._discard_damaged(str(tmp_path / "model")) is False


def test_sealed_folder_copied_elsewhere_still_verifies(tmp_path: Path) -> None:
    """Digests name files relative to their folder: a baked cache copied into a volume stays sealed."""
    hash_dir = _hash_dir(tmp_path / "image")
    seal(hash_dir)
    copy = tmp_path / "volume" / HASH
    shutil.copytree(hash_dir, copy)
    assert damaged_files(copy) == []
