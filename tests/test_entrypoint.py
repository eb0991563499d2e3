"""The images' entrypoint seeds the compile cache per weight-path folder: a folder of a kept volume stamped for
something else (an older image's) is replaced by the image's, one stamped the same is kept as it is. Run as the
image runs it, with `spark-edge` on PATH replaced by a script that records its arguments."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAMP = "spark_edge_cache_stamp.json"


def _tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "spark-edge").write_text('#!/bin/sh\necho "spark-edge $*"\n')
    (bin_dir / "spark-edge").chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SPARK_EDGE_HOME": str(tmp_path / "home"),
        "SPARK_EDGE_BAKED_CACHE": str(tmp_path / "baked"),
    }
    return subprocess.run(
        ["sh", str(REPO / "docker" / "entrypoint.sh"), *args], env=env, capture_output=True, text=True, timeout=60
    )


def test_a_kept_folder_stamped_for_another_image_is_replaced_and_a_matching_one_kept(tmp_path: Path) -> None:
    _tree(
        tmp_path / "baked" / "vllm-cache",
        {
            f"w4a16/{STAMP}": "new",
            "w4a16/compiled.so": "new kernels",
            f"bf16/{STAMP}": "same",
            "bf16/compiled.so": "baked",
        },
    )
    _tree(
        tmp_path / "home" / "vllm-cache",
        {
            f"w4a16/{STAMP}": "old",
            "w4a16/stale.so": "old kernels",
            f"bf16/{STAMP}": "same",
            "bf16/compiled.so": "compiled here",
        },
    )
    result = _run(tmp_path, "serve", "--", "--served-model-name", "x")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "spark-edge serve -- --served-model-name x"  # argv untouched
    cache = tmp_path / "home" / "vllm-cache"
    assert (cache / "w4a16" / STAMP).read_text() == "new" and not (cache / "w4a16" / "stale.so").exists()
    assert (cache / "w4a16" / "compiled.so").read_text() == "new kernels"
    assert (cache / "bf16" / "compiled.so").read_text() == "compiled here"  # same stamp: kept as it was
    assert f"{cache / 'w4a16'} holds a compile cache made for something else" in result.stderr
    assert "bf16 holds" not in result.stderr


def test_other_commands_pass_through_untouched(tmp_path: Path) -> None:
    result = _run(tmp_path, "probe", "--json")
    assert result.returncode == 0 and result.stdout.strip() == "spark-edge probe --json"
    assert not (tmp_path / "home").exists()  # no data folder prepared for a command that does not serve
