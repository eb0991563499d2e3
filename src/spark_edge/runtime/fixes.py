"""Every runtime patch spark-edge applies to vLLM (0.32, CPU build), in one place; with two of the libraries
vLLM's processes run on (torch's gloo process groups, uvicorn's tick), patched for what vLLM makes them do.

vLLM's files are never edited: `apply_runtime_fixes()` wraps a few functions at runtime. It is
called from the `vllm.general_plugins` entry point, which vLLM runs in each of its processes
(API server, engine core, worker), so every process that loads or compiles the model is
patched. Each patch below says which vLLM behaviour it corrects and how it turns itself off
once vLLM no longer needs it. Patches of vLLM modules wait until vLLM imports them
(see post_import): the plugin never imports, say, the CPU worker into the API server.
All of it is idempotent: applying twice, in one process or after a reload, wraps nothing twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
import os
import platform
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from spark_edge.environment import PROCESS_LAYOUT, forced_isa, kernel_enabled
from spark_edge.runtime import cache_digests, compile_cache
from spark_edge.runtime.draining import begin_draining
from spark_edge.runtime.memory import release_free_memory
from spark_edge.runtime.post_import import when_imported

_LOG = logging.getLogger("vllm.spark_edge.fixes")

# Set on every wrapper we install: finding it means "already patched", whatever module
# object or copy of spark-edge installed it.
_MARK = "__spark_edge_fix__"

_applied = False
_apply_lock = threading.Lock()


def apply_runtime_fixes() -> None:
    """Install every patch in this process (idempotent, cheap: no vLLM module is imported)."""
    global _applied
    with _apply_lock:
        if _applied:
            return
        _applied = True
    _patch_torch_load_compiled_function()
    _patch_forced_isa()
    when_imported("vllm.compilation.decorators", _patch_compile_cache_accounting)
    when_imported("vllm.v1.worker.cpu_worker", _patch_cpu_worker_memory_release)
    when_imported("vllm.v1.engine.async_llm", _patch_drain_start)
    when_imported("torch.distributed.distributed_c10d", _patch_single_rank_gloo)
    when_imported("uvicorn.server", _patch_uvicorn_tick)
    when_imported("vllm.v1.engine.core_client", _patch_inproc_async_client)
    when_imported("vllm.renderers.hf", _patch_processor_chat_template)
    if platform.machine() in ("aarch64", "arm64"):
        when_imported("torch._inductor.cpu_vec_isa", _patch_inductor_sve_length)
    when_imported("vllm.v1.attention.backends.cpu_attn", _patch_cpu_attention_step)


def _is_ours(fn: Any) -> bool:
    return getattr(fn, _MARK, None) is not None


def _mark(wrapper: Callable[..., Any], fix: str) -> Callable[..., Any]:
    setattr(wrapper, _MARK, fix)
    return wrapper


def _wrap_attribute(owner: Any, name: str, wrap: Callable[[Any], Callable[..., Any]]) -> None:
    """owner.name = wrap(owner.name), unless it is absent or already one of our wrappers."""
    original = getattr(owner, name, None)
    if original is not None and not _is_ours(original):
        setattr(owner, name, wrap(original))


# --- 1. The AOT compile cache never loads on CPU; a damaged kernel blocks recompiling ----------
#
# vLLM behaviour: `vllm.compilation.decorators._try_load_aot_compiled_fn` loads the artifact with
# `torch.compiler.load_compiled_function`, then calls `loaded._artifacts.compiled_fn
# .finalize_loading(vllm_config)`. Only vLLM's own `VllmSerializableFunction` has that method
# (it builds vLLM's piecewise backend lazily). On CPU, vLLM compiles with the plain "inductor"
# backend (CpuPlatform sets DYNAMO_TRACE_ONCE + backend="inductor"), so torch wraps the result
# in a `BundledAOTAutogradSerializableCallable`, whose __getattr__ forwards to a plain function:
# AttributeError "'function' object has no attribute 'finalize_loading'", which vLLM's handler
# takes for a load failure, so every start recompiles.
#
# Why a no-op is right: torch's `deserialize_compile_artifacts` for that class already rebuilt a
# complete callable (`deserialize_bundled_cache_entry` runs AOTAutograd's post-compile wrappers,
# which import Inductor's generated module and load its kernel .so from the cache's
# inductor_cache/ folder; checked: the .so is mapped before the first call). There is no vLLM
# backend to build, which is all `finalize_loading` does. Measured on the default model (bf16,
# 2 cores): warm start 67-75 s without this (a full recompile), 6-17 s with it.
#
# Turns itself off: only objects lacking `finalize_loading` get one; when vLLM (or torch) gives
# the CPU artifact that method, or vLLM stops calling it, this does nothing.
#
# Same wrapper, second correction: if a kernel .so in that inductor_cache/ is damaged (cut short
# by a crash or a full disk), loading raises ImportError; vLLM counts it as a load failure and
# recompiles, but Inductor finds the damaged .so under the same hash, skips building it and the
# recompile fails with the same ImportError: the engine cannot start until someone deletes the
# file. The wrapper deletes that one file (only a .so under $TORCHINDUCTOR_CACHE_DIR, which vLLM
# points into its own cache) before re-raising, so the recompile rebuilds it. Turns itself off:
# nothing happens unless loading fails with an ImportError naming such a file.


def _nothing_to_finalize(vllm_config: Any) -> None:
    """finalize_loading for torch's own serializable callables: they are complete when deserialized."""


def give_finalize_loading(loaded: Any) -> bool:
    """Give the artifact's compiled_fn a no-op `finalize_loading` if it lacks one; True if it did."""
    compiled_fn = getattr(getattr(loaded, "_artifacts", None), "compiled_fn", None)
    if compiled_fn is None or hasattr(compiled_fn, "finalize_loading"):
        return False
    try:
        compiled_fn.finalize_loading = _nothing_to_finalize
    except (AttributeError, TypeError):
        return False  # an object that refuses attributes: vLLM recompiles, as it would unpatched
    return True


def unloadable_kernel(exc: BaseException, inductor_cache: str | None) -> Path | None:
    """The Inductor kernel .so under `inductor_cache` that `exc` (or its causes) failed to import."""
    if not inductor_cache:
        return None
    root = Path(inductor_cache).resolve()
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        path = getattr(current, "path", None) if isinstance(current, ImportError) else None
        if path and path.endswith(".so") and Path(path).resolve().is_relative_to(root):
            return Path(path)
        current = current.__cause__ or current.__context__
    return None


def _drop_unloadable_kernel(exc: BaseException) -> None:
    kernel = unloadable_kernel(exc, os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
    if kernel is None:
        return
    _LOG.warning(
        "spark-edge: compiled kernel %s cannot be loaded (%s); removing it so the recompile rebuilds it", kernel, exc
    )
    kernel.unlink(missing_ok=True)


def fix_aot_cache_loading(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a `torch.compiler.load_compiled_function`-like function with both corrections above."""
    if _is_ours(original):
        return original

    @functools.wraps(original)
    def load_compiled_function(*args: Any, **kwargs: Any) -> Any:
        try:
            loaded = original(*args, **kwargs)
        except Exception as e:  # Inductor may wrap the ImportError: the chain is searched
            _drop_unloadable_kernel(e)
            raise
        give_finalize_loading(loaded)
        return loaded

    return _mark(load_compiled_function, "aot_cache_loading")


def _patch_torch_load_compiled_function() -> None:
    import torch.compiler

    original = getattr(torch.compiler, "load_compiled_function", None)
    if original is None:
        return
    torch.compiler.load_compiled_function = fix_aot_cache_loading(original)


# --- 2. Compile-cache hit/miss accounting ---------------------------------------------------------
#
# vLLM behaviour: whether the compiled model came from the cache is only visible in the log
# ("Directly load AOT compilation" vs a compile); the API server, which serves /metrics, runs in
# another process and has no counter for it. The wrapper records one event per load attempt in
# $SPARK_EDGE_RUN_DIR/events.jsonl: a hit when vLLM returns the loaded function; a miss when it
# returns None, which covers no artifact yet ("no_artifact") and every load failure
# ("load_failed": a truncated file, where vLLM logs "Compile cache file corrupted.", changed
# source, incompatible torch). After a miss vLLM compiles and atomically replaces the file, so
# a corrupt artifact is rebuilt. With VLLM_FORCE_AOT_LOAD vLLM re-raises instead: also a miss.
# Before the load, the artifact's folder is checked against the digests `serve` recorded
# (cache_digests): damaged files are deleted first, so vLLM finds no artifact and compiles
# ("altered"), where an altered byte might otherwise load and run.
#
# The caller (`_support_torch_compile.__call__`) looks `_try_load_aot_compiled_fn` up as a
# global of vllm.compilation.decorators at every call, so replacing the module attribute is
# enough. Turns itself off: if vLLM renames or removes the function, nothing is patched and a
# warning says the counters will stay at zero.


def _artifact_path(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    path = kwargs.get("aot_compilation_path", args[1] if len(args) > 1 else None)
    return path if isinstance(path, str) else None


def count_compile_cache_loads(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a `_try_load_aot_compiled_fn`-like function to record a hit or miss per call."""
    if _is_ours(original):
        return original

    @functools.wraps(original)
    def _try_load_aot_compiled_fn(*args: Any, **kwargs: Any) -> Any:
        path = _artifact_path(args, kwargs)
        reason = (
            "altered"
            if path is not None and _discard_damaged(path)
            else ("no_artifact" if path is not None and not os.path.exists(path) else "load_failed")
        )
        try:
            loaded = original(*args, **kwargs)
        except BaseException:
            compile_cache.record_event(compile_cache.MISS, reason=reason, path=path)
            raise
        if loaded is None:
            compile_cache.record_event(compile_cache.MISS, reason=reason, path=path)
        else:
            compile_cache.record_event(compile_cache.HIT, path=path)
        return loaded

    return _mark(_try_load_aot_compiled_fn, "compile_cache_accounting")


def _discard_damaged(artifact: str) -> bool:
    """True if the artifact's folder failed its digest check (the damaged files are gone). Never raises."""
    try:
        return bool(cache_digests.discard_if_damaged(Path(artifact)))
    except OSError as e:
        _LOG.warning("spark-edge: could not check compile-cache digests for %s: %s", artifact, e)
        return False


def _patch_compile_cache_accounting(decorators: ModuleType) -> None:
    original = getattr(decorators, "_try_load_aot_compiled_fn", None)
    if original is None:
        _LOG.warning(
            "spark-edge: vllm.compilation.decorators has no _try_load_aot_compiled_fn; "
            "compile-cache hit/miss events will not be recorded"
        )
        return
    decorators._try_load_aot_compiled_fn = count_compile_cache_loads(original)


# --- 3. Freed allocator memory is kept after model load and warm-up -------------------------------
#
# vLLM behaviour: the CPU worker loads weights and then compiles and warms the model up, both of
# which free large temporaries; glibc (or tcmalloc) keeps much of that memory, so the worker's
# RssAnon stays above what it uses for the server's lifetime. And with no explicit KV size the
# worker sizes the KV cache from its RSS right after warm-up (CPUWorker.determine_available_memory).
# Measured on the default model (bf16, 135M): 14-106 MiB returned after load, ~40 MiB after
# warm-up; more for bigger checkpoints, whose load temporaries are bigger.
# The wrappers release free heap memory after `CPUWorker.load_model` (inherited from the GPU
# Worker) and after `CPUModelRunner.warming_up_model`, vLLM 0.32's compile/warm-up step (called
# by determine_available_memory, and by compile_or_warm_up_model for models without KV cache),
# logging RssAnon before and after.
#
# Turns itself off: SPARK_EDGE_RELEASE_MEMORY=0, or no malloc_trim/tcmalloc in the process
# (musl), checked at each call; a method vLLM renamed is skipped with a warning.


def release_memory_after(method: Callable[..., Any], what: str) -> Callable[..., Any]:
    """Wrap a method so the process returns freed heap memory to the OS after it returns."""
    if getattr(method, _MARK, None) == "release_memory":
        return method

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = method(*args, **kwargs)
        release_free_memory(what)
        return result

    return _mark(wrapper, "release_memory")


def _wrap_method(cls: type, name: str, what: str) -> None:
    method = getattr(cls, name, None)
    if method is None:
        _LOG.warning("spark-edge: %s.%s not found; memory is not released after %s", cls.__name__, name, what)
        return
    setattr(cls, name, release_memory_after(method, what))


def _patch_cpu_worker_memory_release(cpu_worker: ModuleType) -> None:
    load = getattr(cpu_worker.CPUWorker, "load_model", None)
    if load is not None and not _is_ours(load):
        cpu_worker.CPUWorker.load_model = map_weights_after(load)  # fix 9, below: before the release
    _wrap_method(cpu_worker.CPUWorker, "load_model", "model load")
    _wrap_method(cpu_worker.CPUModelRunner, "warming_up_model", "compile and warm-up")


# --- 4. New requests during a SIGTERM drain fail with HTTP 500 ------------------------------------
#
# vLLM behaviour: with --shutdown-timeout > 0, SIGTERM makes the API server call
# `AsyncLLM.shutdown(timeout)`, which shuts the tokenizer pool down and then waits for the engine
# to finish its in-flight requests. A request arriving in that window fails with HTTP 500
# "cannot schedule new futures after shutdown". The wrapper marks the start of the drain
# (spark_edge.runtime.draining) before vLLM's shutdown runs; serve's middleware then answers new
# requests with 503. Turns itself off: if AsyncLLM has no `shutdown`, nothing is wrapped (a
# warning says so) and new requests during a drain get whatever vLLM answers.


def mark_drain_start(shutdown: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap an `AsyncLLM.shutdown`-like method to flag the drain before it starts."""
    if _is_ours(shutdown):
        return shutdown

    @functools.wraps(shutdown)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        begin_draining()
        return shutdown(*args, **kwargs)

    return _mark(wrapper, "drain_start")


def _patch_drain_start(async_llm: ModuleType) -> None:
    cls = getattr(async_llm, "AsyncLLM", None)
    if cls is None or getattr(cls, "shutdown", None) is None:
        _LOG.warning(
            "spark-edge: vllm.v1.engine.async_llm.AsyncLLM.shutdown not found; requests "
            "arriving during a SIGTERM drain are not answered 503"
        )
        return
    cls.shutdown = mark_drain_start(cls.shutdown)


# --- 5. An idle engine wakes 1300 times a second: one polling gloo thread per process group ---------
#
# vLLM behaviour: at world size 1 the engine core still creates its world, TP, PP, DP, EP (...) groups,
# each a device group and a CPU group on the gloo backend: 13 `ProcessGroupGloo`s. torch gives each
# its own gloo TCP device, and each device runs a `gloo_tcp_loop` thread that wakes from epoll_wait
# every 10 ms whether or not it has a connection. Measured on the default model (Xeon AMX host): an
# idle server used 2.03% of a core, 1.77 of it in those 13 threads (99 wakeups/s each).
#
# The correction: a group of one rank has no peer to connect to, so its device is never used for
# I/O; every single-rank gloo group of the process shares one device (gloo allows several contexts
# per device), hence one loop thread. torch's Python constructor (store, rank, size, timeout) is
# replaced by a subclass taking the same arguments, so isinstance checks and every collective
# (barrier, all_gather_object, broadcast_object_list: all exercised by the tests) behave as before.
#
# That one thread still woke 100 times a second (0.36% of a core, the largest share left of an idle
# server). Its 10 ms epoll timeout is fixed in gloo, but a thread inherits its creator's timer slack
# (prctl(2) PR_SET_TIMERSLACK), which lets the kernel defer a sleeping thread's timeout by up to that
# much: the shared device is created under a 1 s slack (the creating thread's own slack is restored
# at once), so its loop wakes about once a second. Nothing waits on that loop: it would carry the
# group's socket I/O, and a single-rank group has none. Measured (a gloo world of one, Xeon AMX
# host, 10 s): 99 -> 1.1 wake-ups/s, 0.18% -> 0.004% of a core. Where prctl is missing (not Linux),
# the device is created as before.
#
# Turns itself off: groups of two or more ranks are built exactly as torch builds them; if torch's
# gloo bindings lack `_Options` or `create_default_device`, nothing is patched (a debug line says so).

IDLE_LOOP_SLACK_NS = 1_000_000_000
_PR_SET_TIMERSLACK, _PR_GET_TIMERSLACK = 29, 30


@contextlib.contextmanager
def _timer_slack(ns: int) -> Iterator[None]:
    """Threads started inside inherit a timer slack of `ns`; the calling thread gets its own back after."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
        old = prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0)
    except (OSError, AttributeError):
        old = -1
    if old < 0 or prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(ns), 0, 0, 0) != 0:
        yield
        return
    try:
        yield
    finally:
        prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(old), 0, 0, 0)


def _shared_device_gloo(gloo: type) -> type:
    """A `ProcessGroupGloo` whose single-rank instances share one TCP device (one loop thread)."""
    device: list[Any] = []
    lock = threading.Lock()

    class SingleRankSharedDeviceGloo(gloo):  # type: ignore[misc, valid-type]
        def __init__(self, store: Any, rank: int, size: int, timeout: Any = None, *args: Any) -> None:
            if size != 1 or args or not hasattr(timeout, "total_seconds"):
                super().__init__(store, rank, size, timeout, *args)
                return
            with lock:
                if not device:
                    with _timer_slack(IDLE_LOOP_SLACK_NS):  # the device's loop thread starts here
                        device.append(gloo.create_default_device())
            options = gloo._Options()
            options._devices = [device[0]]
            options._timeout = timeout
            options._threads = 2  # torch's default: two workers per device
            super().__init__(store, rank, size, options)

    setattr(SingleRankSharedDeviceGloo, _MARK, "single_rank_gloo")
    return SingleRankSharedDeviceGloo


def _patch_single_rank_gloo(c10d: ModuleType) -> None:
    gloo = getattr(c10d, "ProcessGroupGloo", None)
    if gloo is None or _is_ours(gloo):
        return
    if not (hasattr(gloo, "_Options") and hasattr(gloo, "create_default_device")):
        _LOG.debug("spark-edge: torch's ProcessGroupGloo has no _Options/create_default_device; not patched")
        return
    c10d.ProcessGroupGloo = _shared_device_gloo(gloo)


# --- 6. An idle API server wakes ten times a second: uvicorn's 100 ms housekeeping tick ------------
#
# Not vLLM's code but the server it runs: uvicorn's `Server.main_loop` sleeps 0.1 s between calls of
# `on_tick`, which refreshes the Date header once a second (every tenth call) and checks
# `should_exit`. Measured on an idle server (default model, Xeon AMX host): the API server's main
# thread used 0.33-0.38% of a core, most of the idle budget of 0.5%.
#
# The correction: tick once a second, advancing the counter by ten, so every call refreshes the Date
# header exactly as every tenth did. vLLM stops the HTTP server by cancelling its task (SIGTERM/SIGINT
# handlers in vLLM's launcher), which is immediate as before; only `should_exit` set by a watchdog
# (engine death, checked every 5 s) or `limit_max_requests` is seen up to a second later.
#
# Turns itself off: if uvicorn's Server has no `main_loop` or `on_tick` (uvicorn changed), nothing
# is patched (a debug line says so).

UVICORN_TICK_S = 1.0


async def _main_loop_once_a_second(self: Any) -> None:
    counter = 0
    should_exit = await self.on_tick(counter)
    while not should_exit:
        counter = (counter + 10) % 864000  # uvicorn's counter: every call is a "once a second" one
        await asyncio.sleep(UVICORN_TICK_S)
        should_exit = await self.on_tick(counter)


def _patch_uvicorn_tick(server: ModuleType) -> None:
    cls = getattr(server, "Server", None)
    loop = getattr(cls, "main_loop", None)
    if loop is None or not hasattr(cls, "on_tick"):
        _LOG.debug("spark-edge: uvicorn.server.Server has no main_loop/on_tick; its tick is left at 100 ms")
        return
    if _is_ours(loop):
        return
    cls.main_loop = _mark(functools.wraps(loop)(_main_loop_once_a_second), "uvicorn_tick")


# --- 8. The `single` process layout: AsyncLLM's engine core on a thread of the server ---------------
#
# vLLM behaviour: `AsyncLLM.__init__` gets its engine client from
# `EngineCoreClient.make_async_mp_client`, which always starts the engine core in a process of its
# own (`make_client` refuses asyncio without multiprocessing). That process imports torch and vLLM
# again: on the default model the two runtimes are most of the server's memory and of its start.
#
# The correction: when the process layout is `single` (SPARK_EDGE_PROCESS_LAYOUT, set by serve),
# `make_async_mp_client` returns spark-edge's in-process client (runtime/inproc_engine.py), which runs
# vLLM's own engine-core loop on a thread. Every other layout is untouched.
#
# Turns itself off: if vLLM's `make_client` no longer refuses an in-process asyncio engine (vLLM then
# ships its own), or `make_async_mp_client` is gone, nothing is patched and a warning says so; serve
# then runs vLLM's layout.

SINGLE_LAYOUT = "single"


def inproc_client_wanted() -> bool:
    return PROCESS_LAYOUT.get() == SINGLE_LAYOUT


def _patch_inproc_async_client(core_client: ModuleType) -> None:
    if not inproc_client_wanted():
        return
    cls = getattr(core_client, "EngineCoreClient", None)
    make = getattr(cls, "make_async_mp_client", None)
    refuses = "without multiprocessing" in _source(getattr(cls, "make_client", None))
    if make is None or not refuses:
        _LOG.warning("spark-edge: vLLM's engine client changed; the single process layout is not installed")
        return
    if _is_ours(make):
        return

    def make_inproc_client(*args: Any, **kwargs: Any) -> Any:
        from spark_edge.runtime.inproc_engine import AsyncInprocClient

        return AsyncInprocClient(*args, **kwargs)

    cls.make_async_mp_client = staticmethod(_mark(make_inproc_client, "inproc_async_client"))


def _source(fn: Any) -> str:
    import inspect

    try:
        return inspect.getsource(fn) if fn is not None else ""
    except (OSError, TypeError):
        return ""


# --- 9. Weights copied into anonymous memory ---------------------------------------------------------
#
# vLLM behaviour: the CPU worker loads every weight into anonymous memory (and the 4-bit paths repack
# them there), so two servers of one model on a node hold the weights twice, and under memory pressure
# the kernel can only kill, not reclaim.
#
# The correction: after `CPUWorker.load_model` has loaded and processed the weights (before compiling),
# runtime/mapped_weights.py writes the large parameters once into a file beside the compile cache and
# replaces them with views of that file's mapping; the copies are freed by fix 3's release right after.
#
# Turns itself off: outside spark-edge serve / warm (no stamped compile cache root), and wherever the file
# cannot be written or read (a warning says so; the weights stay as vLLM loaded them).


def map_weights_after(load_model: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(load_model)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = load_model(self, *args, **kwargs)
        from spark_edge.runtime.mapped_weights import map_model_weights

        map_model_weights(self.model_runner.get_model(), Path(self.vllm_config.model_config.model))
        return result

    return _mark(wrapper, "mapped_weights")


# --- 10. A text model's tokenizer loaded twice to find its chat template -------------------------------
#
# vLLM behaviour: to find a chat template, the renderer first asks transformers' AutoProcessor
# (`vllm.renderers.hf._try_get_processor_chat_template`). For a text-only model AutoProcessor finds no
# processor and falls back to loading the tokenizer a second time, to find no processor chat template:
# 0.51 s of every start (default model, AMD EPYC Zen 4), about 5% of a warm restart.
#
# The correction: where the model is a local folder that holds nothing AutoProcessor builds a processor
# from (no processor or preprocessor config, no `processor_class` in its configs, a model type transformers
# maps to no processor), the lookup answers None at once: what it would have found.
#
# Turns itself off: when vLLM has no `_try_get_processor_chat_template`; for a remote or multimodal model
# the lookup runs as vLLM wrote it.

_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")


def has_no_processor(folder: Path) -> bool:
    """True only where AutoProcessor certainly builds no processor from this folder."""
    import json

    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    if not (folder / "config.json").is_file() or any((folder / name).exists() for name in _PROCESSOR_FILES):
        return False
    try:
        configs = [
            json.loads((folder / name).read_text())
            for name in ("config.json", "tokenizer_config.json")
            if (folder / name).is_file()
        ]
    except (OSError, ValueError):
        return False
    if any("processor_class" in config for config in configs):
        return False
    return configs[0].get("model_type") not in PROCESSOR_MAPPING_NAMES


def skip_absent_processor(lookup: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(lookup)
    def wrapper(tokenizer: Any, *args: Any, **kwargs: Any) -> Any:
        name = str(getattr(tokenizer, "name_or_path", "") or "")
        if name and Path(name).is_dir() and has_no_processor(Path(name)):
            return None
        return lookup(tokenizer, *args, **kwargs)

    return _mark(wrapper, "processor_chat_template")


def _patch_processor_chat_template(hf: ModuleType) -> None:
    _wrap_attribute(hf, "_try_get_processor_chat_template", skip_absent_processor)


# --- 11. A forced ISA does not reach vLLM's own kernel choice ------------------------------------------
# vLLM picks its extension (_C, _C_AVX512 or _C_AVX2), its attention kernels and its AMX GEMMs by torch.cpu's
# CPUID answers, which ATEN_CPU_CAPABILITY leaves alone. Where SPARK_EDGE_FORCED_ISA asks for AVX2 (a benchmark
# of that CPU class on an AVX-512 machine), torch.cpu answers as such a CPU would. Applied before vLLM loads its
# extension (vllm._custom_ops, imported after the plugins run); inactive unless the variable is set, so there
# is nothing for a newer vLLM to turn off.
WIDER_THAN_AVX2 = (
    "_is_avx512_supported",
    "_is_avx512_bf16_supported",
    "_is_vnni_supported",  # torch's name for AVX512-VNNI
    "_is_amx_tile_supported",
    "_is_amx_fp16_supported",
)


def _answering_no(query: Callable[[], bool]) -> Callable[[], bool]:
    @functools.wraps(query)
    def wrapper() -> bool:
        return False

    return _mark(wrapper, "forced_isa")


def _patch_forced_isa() -> None:
    if forced_isa() != "avx2":
        return
    import torch.cpu

    for name in WIDER_THAN_AVX2:
        _wrap_attribute(torch.cpu, name, _answering_no)


# --- 12. Inductor's SVE code assumes 256-bit vectors on every SVE CPU whose vectors are not 128 bits ------------
# torch 2.13's Inductor (cpu_vec_isa.valid_vec_isa_list) takes VecSVE(128) where the CPU's SVE vectors are 128 bits
# and VecSVE(256), compiled with -msve-vector-bits=256, for any other length: on 512-bit SVE (A64FX; qemu-user's
# default arm64 CPU, where the arm64 image runs emulated) the compiled graph computes garbage (a compiled cpu_int4
# linear returned permuted values and zeros under qemu). There the list becomes NEON alone, which every arm64 CPU
# has and Inductor uses where SVE is absent. Turns itself off on CPUs with 128- or 256-bit SVE or none, and once
# torch lists an SVE entry of the CPU's own length.


def sve_vector_bits() -> int:
    """The CPU's SVE vector length in bits as torch reads it (0: no SVE, or not arm64)."""
    import torch.cpu

    return int(torch.cpu.get_capabilities().get("sve_max_length") or 0)


def neon_where_sve_length_is_unknown(valid: Callable[[], list[Any]]) -> Callable[[], list[Any]]:
    @functools.wraps(valid)
    def wrapper() -> list[Any]:
        isas = valid()
        sve = [isa for isa in isas if type(isa).__name__ == "VecSVE"]
        bits = sve_vector_bits() if sve else 0
        if not sve or any(isa.bit_width() == bits for isa in sve):
            return isas
        from torch._inductor.cpu_vec_isa import VecNEON

        _LOG.info("spark-edge: Inductor emits NEON code: it has no SVE code for %d-bit vectors", bits)
        return [VecNEON()]

    return _mark(wrapper, "inductor_sve_length")


def _patch_inductor_sve_length(cpu_vec_isa: ModuleType) -> None:
    _wrap_attribute(cpu_vec_isa, "valid_vec_isa_list", neon_where_sve_length_is_unknown)


# --- 13. CPU attention's per-layer Python work in every decode step --------------------------------------------
# vLLM behaviour: every attention layer calls two of vLLM's custom ops a step, whose CPU methods
# (`CPUAttentionBackendImpl.do_kv_cache_update` and `.forward`) each rebuild the same key and value views of the
# layer's KV cache (`view`, `chunk`), test the encoder cases, slice query and output to the tokens they already
# hold, and reach the C++ kernels through `vllm._custom_ops`' keyword wrappers and the op packets' overload
# lookup. On a small model that is a visible share of a decode step: the profile of the default model (AMD EPYC
# Zen 4, w4a16) has the two ops at 1.05 ms of an 8.3 ms step in their own Python, beside 0.22 ms of attention.
#
# The correction: for decoder attention the views are made once per KV cache tensor (kept on the layer's impl,
# made again when vLLM hands it another tensor) and the two kernels are called through their resolved
# overloads with exactly the arguments vLLM's methods pass; the slices only where there are padding tokens.
# Encoder and encoder-only attention, fused output quantization, warm-up calls without metadata and attention
# sinks not yet cast go to vLLM's methods as written. Measured in one offline engine with the fix switched off
# and on six times (default model, w4a16, AMD EPYC Zen 4, torch profiler over 64 decode steps, medians): the two
# ops with their kernels 1.46 ms a step, against 2.14 ms with vLLM's methods.
#
# Turns itself off: SPARK_EDGE_DISABLED_KERNELS=attention_step; on a vLLM other than the release this restates
# (ATTENTION_STEP_VLLM), or where either kernel's schema differs from the one these calls are written for.
ATTENTION_STEP_VLLM = "0.32."
_ATTENTION_SCHEMAS = {
    "cpu_attn_reshape_and_cache": "key value key_cache value_cache slot_mapping isa k_scale v_scale kv_cache_dtype",
    "cpu_attention_with_kv_cache": "query key_cache value_cache output query_start_loc seq_lens scale causal "
    "alibi_slopes sliding_window_size block_table softcap scheduler_metadata s_aux dynamic_causal k_scale v_scale "
    "kv_cache_dtype",
}
_KV_VIEWS = "_spark_edge_kv_views"


def attention_kernels() -> tuple[Any, Any] | None:
    """vLLM's two CPU attention kernels as resolved overloads, if their schemas are the ones written for."""
    import torch

    ops = getattr(torch.ops, "_C", None)
    kernels = []
    for name, arguments in _ATTENTION_SCHEMAS.items():
        try:
            overload = getattr(ops, name).default
        except (AttributeError, RuntimeError):
            return None
        if " ".join(a.name for a in overload._schema.arguments) != arguments:
            return None
        kernels.append(overload)
    return kernels[0], kernels[1]


def kv_cache_views(impl: Any, kv_cache: Any) -> tuple[Any, Any]:
    """The key and value halves of a layer's KV cache, [blocks, kv heads, block size, head size] each."""
    held = impl.__dict__.get(_KV_VIEWS)
    if held is not None and held[0] is kv_cache:
        return held[1], held[2]
    blocks, kv_heads, block_size, _ = kv_cache.size()
    key_cache, value_cache = kv_cache.view((blocks, kv_heads, block_size * 2, -1)).chunk(2, dim=2)
    impl.__dict__[_KV_VIEWS] = (kv_cache, key_cache, value_cache)
    return key_cache, value_cache


def lean_kv_cache_update(original: Callable[..., Any], reshape_and_cache: Any) -> Callable[..., Any]:
    from vllm.v1.attention.backend import AttentionType

    @functools.wraps(original)
    def wrapper(self: Any, layer: Any, key: Any, value: Any, kv_cache: Any, slot_mapping: Any) -> None:
        if self.attn_type != AttentionType.DECODER:
            return original(self, layer, key, value, kv_cache, slot_mapping)
        key_cache, value_cache = kv_cache_views(self, kv_cache)
        reshape_and_cache(
            key,
            value,
            key_cache,
            value_cache,
            slot_mapping,
            layer.isa,
            layer._k_scale_float,
            layer._v_scale_float,
            self.kv_cache_dtype,
        )

    return _mark(wrapper, "attention_step")


def lean_attention_forward(original: Callable[..., Any], attention: Any) -> Callable[..., Any]:
    import torch
    from vllm.v1.attention.backend import AttentionType

    @functools.wraps(original)
    def wrapper(
        self: Any,
        layer: Any,
        query: Any,
        key: Any,
        value: Any,
        kv_cache: Any,
        attn_metadata: Any,
        output: Any,
        output_scale: Any = None,
        output_block_scale: Any = None,
    ) -> Any:
        sinks = self.sinks
        if (
            attn_metadata is None
            or output_scale is not None
            or output_block_scale is not None
            or self.attn_type != AttentionType.DECODER
            or (sinks is not None and sinks.dtype not in (torch.bfloat16, torch.float32))
        ):
            return original(
                self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )
        key_cache, value_cache = kv_cache_views(self, kv_cache)
        tokens = attn_metadata.num_actual_tokens
        padded = query.size(0) != tokens
        attention(
            query[:tokens] if padded else query,
            key_cache,
            value_cache,
            output[:tokens] if padded else output,
            attn_metadata.query_start_loc,
            attn_metadata.seq_lens,
            self.scale,
            attn_metadata.causal,
            self.alibi_slopes,
            self.sliding_window,
            attn_metadata.block_table,
            self.logits_soft_cap,
            attn_metadata.scheduler_metadata,
            sinks,
            attn_metadata.dynamic_causal,
            layer._k_scale_float,
            layer._v_scale_float,
            self.kv_cache_dtype,
        )
        return output

    return _mark(wrapper, "attention_step")


def _patch_cpu_attention_step(cpu_attn: ModuleType) -> None:
    import vllm

    cls = getattr(cpu_attn, "CPUAttentionBackendImpl", None)
    if cls is None or not kernel_enabled("attention_step") or not vllm.__version__.startswith(ATTENTION_STEP_VLLM):
        return
    kernels = attention_kernels()
    if kernels is None:
        _LOG.info("spark-edge: vLLM's CPU attention kernels changed; its attention step runs as vLLM wrote it")
        return
    reshape_and_cache, attention = kernels
    _wrap_attribute(cls, "do_kv_cache_update", lambda original: lean_kv_cache_update(original, reshape_and_cache))
    _wrap_attribute(cls, "forward", lambda original: lean_attention_forward(original, attention))
