"""`spark-edge serve` on a damaged checkpoint: caught by its manifest at start, before vLLM loads it.

A folder the user points at (`--model DIR`, built by `spark-edge build`) is the user's: a truncated
or altered file is refused with exit code 3 naming the file, and the folder is left exactly as it
was. A build serve made itself in its data folder is serve's: it is rebuilt from the source, saying
so. (A memory limit far too small stops each run right after the checkpoint phase, before vLLM.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from spark_edge.checkpoints.default_model import DEFAULT_MODEL_ID
from spark_edge.checkpoints.fingerprint import file_sha256
from spark_edge.checkpoints.manifest import MANIFEST_NAME, verify_checkpoint

from conftest import flip_middle_byte

TOO_SMALL = str(512 << 20)  # refused by the plan (exit 5), which comes after the checkpoint check


def _serve(home: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "spark_edge.cli",
        "serve",
        "--weight-path",
        "bf16",
        "--port",
        "1",
        "--memory-limit",
        TOO_SMALL,
        *args,
    ]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "SPARK_EDGE_HOME": str(home)}
    )


def _snapshot(folder: Path) -> dict[str, tuple[int, str]]:
    return {p.name: (p.stat().st_size, file_sha256(p)) for p in sorted(folder.iterdir())}


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


@pytest.mark.parametrize(
    "damage, says", [(_truncate, "the manifest says"), (flip_middle_byte, "does not match its sha256")]
)
def test_a_damaged_user_checkpoint_is_refused_with_exit_3_and_left_as_it_is(
    checkpoint_copy: Path, tmp_path: Path, damage, says: str
) -> None:
    damage(checkpoint_copy / "model.safetensors")
    before = _snapshot(checkpoint_copy)
    run = _serve(tmp_path / "home", "--model", str(checkpoint_copy))
    assert run.returncode == 3, run.stderr[-3000:]
    assert f"{checkpoint_copy}: model.safetensors" in run.stderr and says in run.stderr
    assert _snapshot(checkpoint_copy) == before  # nothing rewritten, nothing added
    assert not (tmp_path / "home" / "checkpoints").exists()  # and nothing built in its place


def test_a_corrupt_manifest_is_refused_with_exit_3(checkpoint_copy: Path, tmp_path: Path) -> None:
    (checkpoint_copy / MANIFEST_NAME).write_text('{"format": "spark-edge-checkpoint/1", "files": {"model.safe')
    run = _serve(tmp_path / "home", "--model", str(checkpoint_copy))
    assert run.returncode == 3 and "corrupt manifest" in run.stderr, run.stderr[-3000:]


def test_a_damaged_build_in_the_data_folder_is_rebuilt(bf16_checkpoint: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    own = home / "checkpoints" / f"{DEFAULT_MODEL_ID}-bf16"
    shutil.copytree(bf16_checkpoint, own)
    intact = _snapshot(own)
    flip_middle_byte(own / "model.safetensors")
    run = _serve(home)
    assert "rebuilding (corrupt:" in run.stderr and "model.safetensors" in run.stderr, run.stderr[-3000:]
    assert run.returncode == 5, run.stderr[-3000:]  # then the plan, as always, and only then vLLM
    verify_checkpoint(own)
    assert _snapshot(own) == {**intact, MANIFEST_NAME: _snapshot(own)[MANIFEST_NAME]}  # same bytes again
