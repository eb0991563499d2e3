"""ruff (lint and import order) and its formatter hold for the whole tree, and the packages stay layered."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff missing: it comes with the test extra (pip install -e '.[test]')"
    return subprocess.run([ruff, *args], cwd=REPO, capture_output=True, text=True)


def test_ruff_finds_nothing() -> None:
    done = _ruff("check", "--no-cache", ".")
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_tree_is_formatted() -> None:
    done = _ruff("format", "--check", "--no-cache", ".")
    assert done.returncode == 0, "run `ruff format .`:\n" + done.stdout + done.stderr


def _package_imports() -> dict[str, dict[str, str]]:
    """For each top-level package (or module) of spark_edge, the others it imports and one file that does:
    module-level, function-local and TYPE_CHECKING imports alike."""
    src = REPO / "src" / "spark_edge"
    edges: dict[str, dict[str, str]] = {}
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src)
        package = rel.parts[0].removesuffix(".py")
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names if node.module == "spark_edge"]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] == "spark_edge" and len(parts) > 1 and parts[1] != package:
                    edges.setdefault(package, {}).setdefault(parts[1], str(rel))
    return edges


def test_no_two_top_level_packages_import_each_other() -> None:
    edges = _package_imports()
    both = sorted(
        f"{a} ({edges[a][b]}) <-> {b} ({edges[b][a]})"
        for a in edges
        for b in edges[a]
        if a < b and a in edges.get(b, {})
    )
    assert not both, "layers that import each other:\n" + "\n".join(both)
