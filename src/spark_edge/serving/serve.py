"""`spark-edge serve`: probe -> weight path -> checkpoint -> memory plan -> vLLM, with metrics.

Everything that can refuse (an unsupported CPU, a corrupt checkpoint, a ceiling the
model cannot fit under) refuses here, before vLLM loads a byte, with a documented exit
code, so a supervisor sees a clear error instead of an OOM kill or SIGILL crash loop.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import click

from spark_edge import __version__
from spark_edge.checkpoints.chat_template import missing_template_note
from spark_edge.checkpoints.served import ServedCheckpoint
from spark_edge.checkpoints.synthetic_marker import synthetic_origin
from spark_edge.environment import IMAGE_ISA, MAX_REQUEST_BYTES, RUN_DIR, STUCK_STEP_TIMEOUT
from spark_edge.errors import UnsupportedHostError
from spark_edge.formats.cpu_int4_tensors import check_cpu_int4_tensors
from spark_edge.metrics.process_tree import (
    SERVING_INTERVAL_S,
    SERVING_RESCAN_S,
    TreeRssSampler,
    process_age_seconds,
)
from spark_edge.paths import spark_edge_home
from spark_edge.planning.calibration import record_load_peak
from spark_edge.planning.ceiling import Ceiling, OwnMemory
from spark_edge.planning.compile_state import compile_cache_root, record_compiled
from spark_edge.planning.kv_dtype import VLLM_KV_DTYPE
from spark_edge.planning.memory_plan import PREFILL_CHUNK_TOKENS, MemoryPlan
from spark_edge.planning.serving_plan import plan_compile_key, resolve_plan, resolve_weight_path
from spark_edge.planning.speculation import draft_tokens, vllm_speculative_config
from spark_edge.probe.device import DeviceProfile, probe_device
from spark_edge.probe.images import image_isa_problem
from spark_edge.probe.isa import isa_label
from spark_edge.probe.weight_path_choice import WeightPathChoice
from spark_edge.runtime import draining
from spark_edge.runtime.cache_digests import seal_used
from spark_edge.runtime.compile_cache import cache_stamp, prepare_cache_root, read_events
from spark_edge.serving import passthrough, request_limits
from spark_edge.serving.checkpoint import checkpoint_for_serving
from spark_edge.serving.fast_start import prefetch_compiler_keys, resume_full_collections
from spark_edge.serving.process_layout import (
    DEFAULT_LAYOUT,
    DEFAULT_STUCK_STEP_S,
    layout_args,
    layout_env,
)

# SIGTERM: in-flight requests get this long to finish before they are aborted (vLLM's drain mode)
DEFAULT_SHUTDOWN_TIMEOUT_S = 20  # inside the 30 s Kubernetes gives by default, with room to tear down


@dataclass(frozen=True)
class ServeRequest:
    model: Path | None
    weight_path: str  # "auto" or a weight path name
    priority: str
    host: str
    port: int
    max_model_len: int
    max_num_seqs: int
    memory_limit: int | None = None
    api_key: str | None = field(default=None, repr=False)
    api_key_file: Path | None = None
    shutdown_timeout: int = DEFAULT_SHUTDOWN_TIMEOUT_S
    process_layout: str = DEFAULT_LAYOUT
    kv_cache_dtype: str = "auto"
    speculation: str = "off"  # planning/speculation.py
    stuck_step_timeout: int = DEFAULT_STUCK_STEP_S
    max_request_bytes: int = request_limits.DEFAULT_MAX_REQUEST_BYTES
    vllm_args: tuple[str, ...] = ()  # vLLM's own options, after spark-edge's (serving/passthrough.py)


def resolve_api_key(req: ServeRequest) -> str | None:
    """The key from --api-key / SPARK_EDGE_API_KEY, or the first line of the key file."""
    if req.api_key and req.api_key_file:
        raise click.UsageError("give --api-key or --api-key-file, not both")
    if req.api_key_file is not None:
        try:
            lines = req.api_key_file.read_text().strip().splitlines()
        except OSError as exc:
            raise click.UsageError(f"cannot read the API key file {req.api_key_file}: {exc.strerror}") from exc
        key = lines[0].strip() if lines else ""
        if not key:
            raise click.UsageError(f"the API key file {req.api_key_file} is empty")
        return key
    return req.api_key or None


class _Phases:
    """Startup phases: `imports` (from the process's start to this clock: the interpreter, spark-edge and
    torch), probe, checkpoint, `vllm_imports` (vLLM and its OpenAI server's modules), engine (vLLM's engine
    built: config, tokenizer, weights, compiled graphs, warm-up, KV cache) and `ready` (this clock's start to
    the engine ready). vLLM's app is built after that, before /health answers."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.seconds: dict[str, float] = {"imports": process_age_seconds(os.getpid())}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t = time.monotonic()
        yield
        self.seconds[name] = time.monotonic() - t


def vllm_argv(req: ServeRequest, served: ServedCheckpoint, plan: MemoryPlan) -> list[str]:
    method = served.kind.method
    return [
        "--model", str(served.folder),
        "--served-model-name", served.served_name,
        "--host", req.host,
        "--port", str(req.port),
        "--dtype", "bfloat16",
        "--max-model-len", str(plan.max_model_len),
        "--max-num-seqs", str(req.max_num_seqs),
        # the plan bounds what one step holds (a prompt_logprobs step keeps logits for every token of it)
        "--max-num-batched-tokens", str(plan.max_num_batched_tokens),
        "--kv-cache-memory-bytes", str(plan.kv_bytes),
        "--kv-cache-dtype", VLLM_KV_DTYPE[plan.kv_cache_dtype],
        "--shutdown-timeout", str(req.shutdown_timeout),
        # one `--middleware=X` each: vLLM's parser appends them, and warns of "duplicate keys" if given as
        # `--middleware X` twice
        f"--middleware={draining.MIDDLEWARE}",  # 503, not 500, for requests arriving during that drain
        f"--middleware={request_limits.MIDDLEWARE}",  # 413 before a body over the limit is read
        *layout_args(req.process_layout),
        *(["--quantization", method] if method else []),
        *(["--speculative-config", spec] if (spec := vllm_speculative_config(plan.draft_tokens)) else []),
        *req.vllm_args,  # what spark-edge decides was refused before (passthrough.py); the rest goes as given
    ]  # fmt: skip


def import_time_env(layout: str) -> dict[str, str]:
    """What vLLM and the Hugging Face libraries read at import (set before the first import of either)."""
    return {
        **layout_env(layout),
        # Nothing is ever fetched from a model hub: the checkpoint is local.
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        # Inductor precompiles torch's headers before it loads a compiled graph's library, into /tmp, which a
        # container starts without: every warm container start ran g++ for ~5 s and ~490 MiB, beyond the plan
        # (serving/fast_start.py). A graph's one or two C++ files compile as fast without it.
        "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0",
    }


def server_env(device: DeviceProfile, run_dir: Path, cache_root: Path, layout: str = DEFAULT_LAYOUT) -> dict[str, str]:
    """Environment for vLLM and its worker processes (set before vLLM is imported)."""
    env = {
        **import_time_env(layout),
        "VLLM_CACHE_ROOT": str(cache_root),
        RUN_DIR.name: str(run_dir),
    }
    cores = device.cpus
    if cores.usable_cores < len(cores.affinity):
        # a CPU quota below the affinity mask: bind the worker's OpenMP threads to that many cores
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in cores.affinity[: cores.usable_cores])
    return env


def _fresh_run_dir() -> Path:
    run_dir = spark_edge_home() / "run" / str(os.getpid())
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in run_dir.iterdir():  # a reused pid: last run's events are not ours
        stale.unlink()
    return run_dir


@dataclass
class Prepared:
    device: DeviceProfile
    choice: WeightPathChoice
    served: ServedCheckpoint
    weight_path: str  # of the checkpoint actually served
    plan: MemoryPlan
    run_dir: Path
    cache_root: Path
    phases: _Phases
    sampler: TreeRssSampler
    ceiling: Ceiling


def _refuse_wrong_image(device: DeviceProfile) -> None:
    """In a spark-edge image (SPARK_EDGE_IMAGE_ISA is baked in), refuse a CPU the image was not built for.

    Its kernels would die with SIGILL deep in vLLM; the message names the image to use instead.
    """
    image_isa = IMAGE_ISA.get()
    problem = image_isa_problem(image_isa, device) if image_isa else None
    if problem is not None:
        raise UnsupportedHostError(problem)


def prepare(req: ServeRequest, log: Callable[[str], None]) -> Prepared:
    """Everything before vLLM; raises UnsupportedHostError, CheckpointError or PlanRefused."""
    phases = _Phases()
    sampler = TreeRssSampler(os.getpid()).start()
    with phases.phase("probe"):
        device = probe_device()
        own = OwnMemory.now()  # at the moment the cgroup's usage was read
        _refuse_wrong_image(device)
        choice = resolve_weight_path(device, req.priority, req.weight_path, req.model)
    with phases.phase("checkpoint"):
        served = checkpoint_for_serving(req.model, choice.name, log)
        check_cpu_int4_tensors(served.folder, served.config)
        served.check_published_tensors()
        if origin := synthetic_origin(served.config):
            log(f"model: {origin}: for sizing and speed only, its text is noise")
        if note := missing_template_note(served.folder, req.vllm_args):
            log(note)
    resolved = resolve_plan(
        device,
        choice,
        served.folder,
        served.config,
        req.memory_limit,
        req.max_model_len,
        req.max_num_seqs,
        req.process_layout,
        own,
        req.kv_cache_dtype,
        served.kind,
        draft_tokens(req.speculation),
    )
    path, plan, ceiling = resolved.weight_path, resolved.plan, resolved.ceiling
    return Prepared(
        device,
        choice,
        served,
        path,
        plan,
        _fresh_run_dir(),
        compile_cache_root(path),
        phases,
        sampler,
        ceiling,
    )


def startup_summary(p: Prepared) -> str:
    d, c = p.device, p.choice
    unverified = "" if c.verified else " [not yet verified on this CPU class]"
    return (
        f"device: {d.machine} {isa_label(d)}, {d.cpus.usable_cores} usable cores, {p.ceiling.describe()} | "
        f"weight path: {p.weight_path} ({c.reason}){unverified} | plan: {p.plan.summary()}"
    )


def run(req: ServeRequest, log: Callable[[str], None], serve: bool = True) -> None:
    """Serve; with serve=False, load and compile (filling the compile cache) and stop (`spark-edge warm`)."""
    api_key = resolve_api_key(req)
    users_env = dict(os.environ)
    os.environ.update(import_time_env(req.process_layout))
    # before the checkpoint and the plan: a refused option costs seconds, not a build
    passthrough.check_pass_through(req.vllm_args, users_env, layout_env(req.process_layout))
    p = prepare(req, log)
    env = server_env(p.device, p.run_dir, p.cache_root, req.process_layout)
    os.environ.update(env)
    os.environ[MAX_REQUEST_BYTES.name] = str(req.max_request_bytes)  # read by the middleware in this process
    os.environ[STUCK_STEP_TIMEOUT.name] = str(req.stuck_step_timeout)  # read by the single layout's engine watchdog
    if api_key:
        # vLLM guards /v1/* (and /v2, /inference) with it; /health and /metrics stay open for probes.
        # Through the environment, not argv: vLLM logs its non-default arguments.
        os.environ["VLLM_API_KEY"] = api_key
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # vLLM 0.32 lets it replace --kv-cache-memory-bytes
    stamp = cache_stamp(sorted(p.device.features), p.weight_path)
    cache = prepare_cache_root(p.cache_root, stamp)
    from spark_edge.serving.launch import import_vllm_server, run_openai_server

    with p.phases.phase("vllm_imports"):
        import vllm  # only now: some of vLLM's settings are read from the environment at import

        prefetch_compiler_keys()  # hashed on the second core while vLLM's server imports
        import_vllm_server()
    from spark_edge.metrics.prometheus import ServerFacts, install

    facts = ServerFacts(
        isa=isa_label(p.device),
        weight_path=p.weight_path,
        version=__version__,
        vllm_version=vllm.__version__,
        memory_limit_bytes=p.plan.ceiling_bytes,
        run_dir=p.run_dir,
        startup_seconds=p.phases.seconds,
        max_model_len=p.plan.max_model_len,
        requested_max_model_len=p.plan.requested_max_model_len,
        plan_steady_bytes=p.plan.steady_bytes,
        plan_file_backed_bytes=p.plan.file_backed_bytes,
        plan_load_peak_bytes=p.plan.load_peak_bytes,
        plan_peak_bytes=p.plan.peak_bytes,
    )
    install(facts, p.sampler)
    log(
        startup_summary(p)
        + f" | compile cache: {p.cache_root} ({cache.reason})"
        + (" | API key required on /v1" if api_key else "")
    )
    if passed := passthrough.describe(req.vllm_args, users_env, set(env)):
        log(passed)
    for note in p.choice.notes:
        log(f"note: {note}")
    if p.plan.reduced_context:
        log(
            f"memory: serving a {p.plan.max_model_len}-token context, not the {p.plan.requested_max_model_len} "
            f"asked for: only that fits under the {p.ceiling.describe()}"
        )
    if req.kv_cache_dtype == "auto" and p.plan.kv_cache_dtype == "fp8":
        log(
            f"memory: an fp8 KV cache, not bf16: with bf16 only a shorter context than {p.plan.max_model_len} "
            f"tokens fits under the {p.ceiling.describe()} (--kv-cache-dtype bf16 to keep bf16)"
        )
    if p.plan.reduced_prefill_chunk:
        log(
            f"memory: prefilling {p.plan.max_num_batched_tokens} tokens per step, not {PREFILL_CHUNK_TOKENS}: "
            f"only that fits under the {p.ceiling.describe()}"
        )
    engine_start = time.monotonic()

    def on_engine_ready() -> None:
        now = time.monotonic()
        resume_full_collections()
        p.phases.seconds["engine"] = now - engine_start
        p.phases.seconds["ready"] = now - p.phases.start
        facts.load_peak_bytes = p.sampler.peak
        p.sampler.set_pace(SERVING_INTERVAL_S, SERVING_RESCAN_S)  # the load peak is taken: no need for 20 ms
        seal_used(read_events(p.run_dir))  # what this run loaded or compiled is checked at the next start
        record_compiled(p.cache_root, stamp, plan_compile_key(p.served.folder, p.plan))  # the next start plans warm
        log(
            f"ready in {now - p.phases.start:.1f} s; load peak {p.sampler.peak / 2**20:.0f} MiB anonymous RSS "
            f"(plan: {p.plan.load_peak_bytes / 2**20:.0f} MiB)"
        )
        if p.sampler.peak > p.plan.load_peak_bytes:
            baseline = record_load_peak(
                sorted(p.device.features), p.plan, req.process_layout, p.sampler.peak, p.device.cpu_model
            )
            log(
                f"memory: the load peak ran {(p.sampler.peak - p.plan.load_peak_bytes) / 2**20:.0f} MiB over the "
                f"plan on this host; its runtime baseline is now calibrated at {baseline / 2**20:.0f} MiB for the "
                f"next start (planning/calibration.py)"
            )

    memory = f"{p.ceiling.describe()}, the plan's peak {p.plan.peak_bytes / 2**20:.0f} MiB"
    run_openai_server(vllm_argv(req, p.served, p.plan), on_engine_ready, serve, memory)
