"""Print spark-edge's runtime requirements from pyproject.toml, one per line.

The image installs them before copying the source, so a code change does not reinstall torch
and vLLM; reading them from pyproject.toml keeps one list of dependencies, not two.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path


def requirements(pyproject: Path) -> list[str]:
    with pyproject.open("rb") as f:
        return list(tomllib.load(f)["project"]["dependencies"])


if __name__ == "__main__":
    print("\n".join(requirements(Path(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml"))))
