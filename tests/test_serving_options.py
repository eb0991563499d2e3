"""Serve options that shape the vLLM process tree, and the bench's arm specs that compare them."""

from __future__ import annotations

import click
import pytest

from spark_edge.bench.command import parse_arm
from spark_edge.serving.process_layout import DEFAULT_LAYOUT, layout_args, layout_env


def test_the_layouts_vllm_options_and_environment() -> None:
    assert DEFAULT_LAYOUT == "single"  # measured no slower than engine, in less memory (process_layout.py)
    # vLLM's CPU platform turns "uni" into "mp" unless this is 0 (platforms/cpu.py, vLLM 0.32); the layout's own
    # variable tells runtime/fixes.py whether to run the engine core on a thread
    assert layout_env("engine") == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "SPARK_EDGE_PROCESS_LAYOUT": "engine"}
    assert layout_env("single") == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "SPARK_EDGE_PROCESS_LAYOUT": "single"}
    assert layout_args("engine") == layout_args("single") == ["--distributed-executor-backend", "uni"]
    assert layout_args("split") == ["--distributed-executor-backend", "mp"]
    with pytest.raises(ValueError, match="unknown process layout"):
        layout_env("threads")


def test_arm_specs() -> None:
    assert parse_arm("w4a16") == ("w4a16", (), {})
    assert parse_arm("w4a16@split") == ("w4a16", ("--process-layout", "split"), {})
    assert parse_arm("bf16@engine+torch-dequant") == (
        "bf16",
        ("--process-layout", "engine"),
        {"SPARK_EDGE_DISABLED_KERNELS": "spark_edge_int4"},
    )
    assert parse_arm("w4a16+cpp-wrapper")[2] == {"TORCHINDUCTOR_CPP_WRAPPER": "1", "VLLM_USE_LAYERNAME": "0"}
    for bad, message in (
        ("w5a16", "unknown weight path"),
        ("w4a16@threads", "unknown process layout"),
        ("w4a16+turbo", "unknown variant"),
    ):
        with pytest.raises(click.UsageError, match=message):
            parse_arm(bad)


def test_allocator_variants_preload_debians_libraries(monkeypatch: pytest.MonkeyPatch) -> None:
    from spark_edge.runtime import allocator

    for name, library in allocator.LIBRARIES.items():
        preload = parse_arm(f"w4a16+{name}")[2]["LD_PRELOAD"]
        assert preload.endswith(library)
        found = allocator.library_path(name)
        assert found is None or (found.is_file() and str(found) == preload)
    assert parse_arm("w4a16+arena2")[2] == {"MALLOC_ARENA_MAX": "2"}
    monkeypatch.setitem(allocator.LIBRARIES, "jemalloc", "libjemalloc.so.999")
    assert allocator.library_path("jemalloc") is None  # not installed: the caller says so
