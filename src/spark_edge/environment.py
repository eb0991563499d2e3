"""Every SPARK_EDGE_* environment variable, declared once: its name, default, whom it is for and what it does.

serve's settings (settings.py) take their variables' names from here, the other variables are read through
these declarations and never by name elsewhere, and the README's table of them is generated from this list
(scripts/readme_tables.py), as vLLM keeps its variables in envs.py. A variable that was retired is refused
by name at start, with what replaced it, rather than silently ignored.

Standard library only: the kernels and vLLM's worker processes read it before anything else is imported.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

SETTING = "setting"  # a serve/warm option's variable (settings.py holds its flag, default and help)
OPERATOR = "operator"
BENCHMARK = "benchmark"  # side-by-side comparisons, not for production
IMAGE = "image"  # set by the images' Dockerfile
INTERNAL = "internal"  # set by serve for the processes it starts; never by hand
BUILD = "build"  # read by the repository's scripts (make, image builds, deploy/compose), not by spark-edge


@dataclass(frozen=True)
class Variable:
    name: str
    audience: str
    help: str = ""
    default: str | None = None

    def get(self, env: Mapping[str, str] | None = None) -> str | None:
        return (os.environ if env is None else env).get(self.name, self.default)

    def is_off(self) -> bool:
        """A switch that is on unless set to 0."""
        return (self.get() or "1").strip() == "0"


def _setting(option: str) -> Variable:
    return Variable(f"SPARK_EDGE_{option.upper()}", SETTING, f"`--{option.replace('_', '-')}`")


MODEL = _setting("model")
WEIGHT_PATH = _setting("weight_path")
PRIORITY = _setting("priority")
HOST = _setting("host")
PORT = _setting("port")
MAX_MODEL_LEN = _setting("max_model_len")
MAX_NUM_SEQS = _setting("max_num_seqs")
MEMORY_LIMIT = _setting("memory_limit")
API_KEY = _setting("api_key")
API_KEY_FILE = _setting("api_key_file")
SHUTDOWN_TIMEOUT = _setting("shutdown_timeout")
MAX_REQUEST_BYTES = _setting("max_request_bytes")  # also read by the body-limit middleware, serve sets it
KV_CACHE_DTYPE = _setting("kv_cache_dtype")
SPECULATION = _setting("speculation")
# single layout: a step that has not returned after this many seconds (serve exports --stuck-step-timeout to its
# own environment, the engine watchdog reads it) is a stuck engine, and the server exits 7 as if its engine process
# had died. The longest honest step is a prefill chunk: 512 tokens of a 2B model on a host without bf16 hardware.
STUCK_STEP_TIMEOUT = Variable("SPARK_EDGE_STUCK_STEP_TIMEOUT", SETTING, "`--stuck-step-timeout`", "120")
PROCESS_LAYOUT = _setting("process_layout")  # also read by runtime/fixes.py in the process serve runs vLLM in

HOME = Variable(
    "SPARK_EDGE_HOME",
    OPERATOR,
    "The data folder: built checkpoints, compile caches, mapped weights, calibration records "
    "(default: $XDG_CACHE_HOME/spark-edge, else ~/.cache/spark-edge; the images: /var/cache/spark-edge).",
)
VLLM_ARGS = Variable(
    "SPARK_EDGE_VLLM_ARGS",
    OPERATOR,
    "vLLM's own server options as shell words, placed before those after `--` (the images' and manifests' way).",
)
RELEASE_MEMORY = Variable(
    "SPARK_EDGE_RELEASE_MEMORY",
    OPERATOR,
    "0: keep the heap freed after load and compile in the process instead of returning it to the kernel "
    "(malloc_trim, tcmalloc's release).",
    "1",
)
DISABLED_KERNELS = Variable(
    "SPARK_EDGE_DISABLED_KERNELS",
    BENCHMARK,
    "Comma-separated kernels and step patches to leave out, for side-by-side benchmarks: "
    "`spark_edge_int4` (the whole C++ library: torch's ops serve), `int4_gemm` (every native GEMM: tinygemm "
    "rows, dequantization + oneDNN), `int4_gemm_q8` (decode on fp32 activations), `int4_gemm_bf16` and "
    "`int4_gemm_amx` (prefill on dequantization + oneDNN), `kleidiai` (arm64: the linears on tinygemm rows and "
    "dequantization instead of KleidiAI), `int8_rows_gemm` (the 8-bit head on PyTorch's `_weight_int8pack_mm` where "
    "no integer dot product serves it), `int8_packed_gemm` (the 8-bit head on oneDNN's int8 matmul, which keeps a "
    "copy of the table, where vLLM's packed int8 GEMM serves it: AVX512-VNNI, AMX), `attention_step` (runtime fix "
    "13: vLLM's CPU attention methods as vLLM wrote them).",
    "",
)
FORCED_ISA = Variable(
    "SPARK_EDGE_FORCED_ISA",
    BENCHMARK,
    "`avx2`: run as on a CPU with AVX2, FMA and F16C (and AVX-VNNI where this one has it), for measuring that "
    "class on an AVX-512 machine (`bench --isa avx2`): the probe, ATen and Inductor, oneDNN, vLLM's `_C_AVX2` "
    "kernels and spark-edge's x86-64-v3 library all take their AVX2 code.",
    "",
)
BAKED_CACHE = Variable(
    "SPARK_EDGE_BAKED_CACHE", IMAGE, "Where the image keeps its baked compile cache and mapped weights (read-only)."
)
IMAGE_ISA = Variable(
    "SPARK_EDGE_IMAGE_ISA", IMAGE, "The ISA the image was built for: serve refuses another CPU (exit 4)."
)
RUN_DIR = Variable(
    "SPARK_EDGE_RUN_DIR", INTERNAL, "This start's run folder, where vLLM's processes append compile-cache events."
)
ENGINE_LOCK = Variable(
    "SPARK_EDGE_ENGINE_LOCK",
    BUILD,
    "The machine-wide lock image builds and the test suite's engines take, so two never share the cores "
    "(empty: the caller already holds it).",
    "/tmp/spark_edge_engine.lock",
)
VENV = Variable(
    "SPARK_EDGE_VENV",
    BUILD,
    "Where `make setup` (default `.venv`) and an image's install (`/opt/spark-edge/venv`) put the virtual environment.",
)
IMAGE_CACHE = Variable(
    "SPARK_EDGE_IMAGE_CACHE",
    BUILD,
    "Where image builds keep their base root filesystems, by key.",
    "/var/cache/spark-edge-images",
)
IMAGE = Variable("SPARK_EDGE_IMAGE", BUILD, "deploy/compose: the image for this box's CPU.", "spark-edge:avx512")

VARIABLES: tuple[Variable, ...] = tuple(v for v in globals().values() if isinstance(v, Variable))

KERNELS = (
    "spark_edge_int4",
    "int4_gemm",
    "int4_gemm_q8",
    "int4_gemm_bf16",
    "int4_gemm_amx",
    "kleidiai",
    "int8_rows_gemm",
    "int8_packed_gemm",
    "attention_step",
)

# retired variable -> what replaced it
RETIRED = {
    "SPARK_EDGE_NATIVE_DEQUANT": f"{DISABLED_KERNELS.name}=spark_edge_int4",
    "SPARK_EDGE_NATIVE_GEMM": f"{DISABLED_KERNELS.name}=int4_gemm",
    "SPARK_EDGE_INT4_Q8": f"{DISABLED_KERNELS.name}=int4_gemm_q8",
    "SPARK_EDGE_INT4_TILES": f"{DISABLED_KERNELS.name}=int4_gemm_bf16,int4_gemm_amx",
}


# what each forced ISA sets for the libraries that choose their kernels themselves, before they load
FORCED_ISA_ENV = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2_VNNI"}}


def forced_isa(env: Mapping[str, str] | None = None) -> str | None:
    """The ISA SPARK_EDGE_FORCED_ISA names, or None (also for a bad value: the command line refuses it first)."""
    value = (FORCED_ISA.get(env) or "").strip()
    return value if value in FORCED_ISA_ENV else None


def _check_forced_isa(env: Mapping[str, str] | None = None) -> None:
    value = (FORCED_ISA.get(env) or "").strip()
    if value and value not in FORCED_ISA_ENV:
        raise ValueError(f"{FORCED_ISA.name}: {value!r} cannot be forced (choose from: {', '.join(FORCED_ISA_ENV)})")


def apply_forced_isa(env: MutableMapping[str, str] = os.environ) -> None:
    """Export the forced ISA's variables to `env`: by default this process and its children (before torch is
    imported)."""
    if (isa := forced_isa(env)) is not None:
        env.update(FORCED_ISA_ENV[isa])


def disabled_kernels(env: Mapping[str, str] | None = None) -> frozenset[str]:
    """The kernels named in SPARK_EDGE_DISABLED_KERNELS; ValueError for a name that is not a kernel."""
    names = frozenset(n.strip() for n in (DISABLED_KERNELS.get(env) or "").split(",") if n.strip())
    if unknown := sorted(names - set(KERNELS)):
        raise ValueError(
            f"{DISABLED_KERNELS.name}: no kernel named {', '.join(unknown)} (kernels: {', '.join(KERNELS)})"
        )
    return names


def kernel_enabled(name: str) -> bool:
    """Whether `name` (one of KERNELS) may run; a bad list reads as empty here (serve refuses it at start)."""
    try:
        return name not in disabled_kernels()
    except ValueError:
        return True


def environment_problems(env: Mapping[str, str] | None = None) -> list[str]:
    """What is wrong with this environment's SPARK_EDGE_* variables: a retired one set, a bad kernel name."""
    env = os.environ if env is None else env
    problems = [f"{name} was retired: use {instead}" for name, instead in RETIRED.items() if name in env]
    for check in (disabled_kernels, _check_forced_isa):
        try:
            check(env)
        except ValueError as exc:
            problems.append(str(exc))
    return problems
