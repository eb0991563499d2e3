"""SPARK_EDGE_FORCED_ISA=avx2 (bench --isa avx2): one setting reaches every library that picks kernels itself."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from spark_edge import environment
from spark_edge.bench.peer_build import cmake_args
from spark_edge.bench.runner import format_table
from spark_edge.probe.cpu_features import FORCED_ISA_FLAGS, X86_FEATURES, all_cpu_flags, probe_cpu_features

X86_HOST = pytest.mark.skipif(platform.machine() != "x86_64", reason="an x86 ISA")
WIDER_THAN_AVX2 = pytest.mark.skipif(
    platform.machine() != "x86_64" or not {"avx512f", "avx2"} <= set(all_cpu_flags()) & set(X86_FEATURES),
    reason="forcing AVX2 needs an x86 CPU wider than AVX2",
)


def _forced_child(code: str) -> Any:
    """Run `code` in a child process forced to AVX2; the JSON of its last printed line."""
    env = {**os.environ, "SPARK_EDGE_FORCED_ISA": "avx2", "VLLM_NO_USAGE_STATS": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_bad_forced_isa_is_refused_by_name() -> None:
    problems = environment.environment_problems({"SPARK_EDGE_FORCED_ISA": "avx512"})
    assert problems == ["SPARK_EDGE_FORCED_ISA: 'avx512' cannot be forced (choose from: avx2)"]
    assert environment.forced_isa({"SPARK_EDGE_FORCED_ISA": "avx512"}) is None
    assert environment.environment_problems({"SPARK_EDGE_FORCED_ISA": "avx2"}) == []


def test_forcing_exports_what_aten_inductor_and_onednn_read() -> None:
    # a dict, not this process's environment: a forced ISA left behind would reach every later test's servers
    env = {"SPARK_EDGE_FORCED_ISA": "avx2"}
    environment.apply_forced_isa(env)
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["ONEDNN_MAX_CPU_ISA"] == "AVX2_VNNI"
    unforced = {"PATH": "/bin"}
    environment.apply_forced_isa(unforced)
    assert unforced == {"PATH": "/bin"}


@X86_HOST
def test_the_probe_and_the_builds_see_an_avx2_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARK_EDGE_FORCED_ISA", "avx2")
    assert probe_cpu_features(Path("/"), "x86_64").names <= {"avx2", "fma", "f16c"}
    flags = frozenset(all_cpu_flags())
    assert flags <= FORCED_ISA_FLAGS["avx2"]
    args = cmake_args(flags, "x86_64")  # llama.cpp named flag by flag: -march=native would take AVX-512
    assert "-DGGML_NATIVE=OFF" in args and "-DGGML_AVX512=OFF" in args and "-DGGML_AVX2=ON" in args
    # a recorded /proc (another machine) is not narrowed
    assert probe_cpu_features(Path("/nonexistent"), "x86_64").source == "none"


def test_without_avx512_llama_cpp_is_built_flag_by_flag_and_otherwise_native() -> None:
    assert "-DGGML_NATIVE=OFF" in cmake_args(frozenset({"avx", "avx2", "fma", "f16c"}), "x86_64")
    assert "-DGGML_NATIVE=ON" in cmake_args(frozenset({"avx2", "avx512f", "avx512bw"}), "x86_64")
    assert "-DGGML_NATIVE=ON" in cmake_args(frozenset({"asimd"}), "aarch64")


def test_the_table_says_the_run_was_forced() -> None:
    summary = {"baseline": "bf16", "arms": {"bf16": {"passes": 2, "runs": []}}, "host": "Xeon, 2 usable cores"}
    assert "forced" not in format_table(summary)
    first = format_table({**summary, "forced_isa": "avx2"}).splitlines()[0]
    assert first == "forced avx2: every arm ran its avx2 kernels on Xeon, 2 usable cores"


CHILD = """
import json, torch
from spark_edge.environment import apply_forced_isa
apply_forced_isa()
from spark_edge.plugin import register
register()
import vllm._custom_ops  # vLLM loads its extension here, after the plugins ran (as in every engine)
from torch._inductor.cpu_vec_isa import pick_vec_isa
from spark_edge.kernels.native_int4 import host_target
maps = open("/proc/self/maps").read()
print(json.dumps({
    "extension": sorted({line.split("/")[-1] for line in maps.splitlines() if "/vllm/_C" in line}),
    "aten": torch.backends.cpu.get_cpu_capability(),
    "inductor": str(pick_vec_isa()),
    "avx512": torch.cpu._is_avx512_supported(), "amx": torch.cpu._is_amx_tile_supported(),
    "library_target": host_target(),
}))
"""


@WIDER_THAN_AVX2
def test_forced_avx2_reaches_vllms_extension_aten_inductor_and_our_library() -> None:
    assert _forced_child(CHILD) == {
        "extension": ["_C_AVX2.abi3.so"],
        "aten": "AVX2",
        "inductor": "avx2",
        "avx512": False,
        "amx": False,
        "library_target": "x86-64-v3",
    }


KERNEL_BENCH_CHILD = """
import json
from spark_edge.environment import apply_forced_isa
apply_forced_isa()
from spark_edge.bench.kernels import measure
(row,) = measure([("probe", 64, 128)], 32, rows=(1,))
print(json.dumps(sorted(key for key in row if key.endswith("_ms"))))
"""


@WIDER_THAN_AVX2
def test_the_kernel_bench_runs_vllms_kernels_as_a_forced_engine_would() -> None:
    """bench --isa avx2 --kernels: vLLM's wna16 GEMM runs in its AVX2 form, not on AMX tiles (SIGILL)."""
    timed = _forced_child(KERNEL_BENCH_CHILD)
    assert "native_ms" in timed and "amx_ms" not in timed and "tiles_ms" not in timed
