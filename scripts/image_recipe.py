"""What docker/build-image.sh builds for an image of spark-edge's registry (repository tooling, not the product).

    python scripts/image_recipe.py image-args NAME   # its Docker build arguments, as KEY=VALUE lines
    python scripts/image_recipe.py dockerfile NAME   # the Dockerfile text docker builds

NAME is the suffix of the image's Dockerfile (Dockerfile.NAME).
"""

from __future__ import annotations

import sys
from pathlib import Path

from spark_edge.checkpoints.default_model import DEFAULT_MODEL_ID
from spark_edge.registry import IMAGES, Image

REPO = Path(__file__).resolve().parents[1]


def dockerfile_text(image: Image) -> str:
    """What docker builds: the image's own Dockerfile (what it is: its ARG defaults), then the shared recipe."""
    text = (REPO / image.dockerfile).read_text()
    return text + (REPO / image.recipe).read_text() if image.recipe else text


def build_args(image: Image) -> dict[str, str]:
    return {
        "IMAGE_ISA": image.isa,
        "WEIGHT_PATH": image.weight_path,
        "ARCH": image.arch,
        "SERVED_NAME": DEFAULT_MODEL_ID,
        **({"KERNEL_TARGET": image.kernel_target} if image.recipe else {}),
    }


def main(args: list[str]) -> int:
    names = {i.name: i for i in IMAGES.values()}
    if len(args) != 2 or args[0] not in ("image-args", "dockerfile") or args[1] not in names:
        print(f"usage: python scripts/image_recipe.py image-args|dockerfile {'|'.join(names)}", file=sys.stderr)
        return 2
    chosen = names[args[1]]
    if args[0] == "dockerfile":
        sys.stdout.write(dockerfile_text(chosen))
    else:
        sys.stdout.writelines(f"{key}={value}\n" for key, value in build_args(chosen).items())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
