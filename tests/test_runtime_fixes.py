"""Runtime patches of vLLM (spark_edge.runtime): compile-cache stamp and events, the AOT
`finalize_loading` shim, memory release, and the post-import hook that applies them.

End to end, a restart that loads the compiled graph instead of compiling it, with the heap released
after loading and warm-up, is test_server_lifecycle's warm restart; a damaged cache counted and
rebuilt, its damaged-cache restart.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from spark_edge.environment import RELEASE_MEMORY, RUN_DIR
from spark_edge.runtime import compile_cache, fixes, post_import
from spark_edge.runtime.compile_cache import (
    HIT,
    MISS,
    STAMP_FILE,
    cache_stamp,
    prepare_cache_root,
    read_events,
    record_event,
)
from spark_edge.runtime.memory import release_free_memory, releasers


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    run = tmp_path / "run"
    monkeypatch.setenv(RUN_DIR.name, str(run))
    return run


def _stamp(**changes: Any) -> dict[str, Any]:
    return {**cache_stamp(["avx2", "fma", "f16c", "avx512f"], "bf16"), **changes}


def _fill(root: Path) -> None:
    """Something shaped like vLLM's compile cache."""
    artifact = root / "torch_compile_cache" / "torch_aot_compile" / "abc" / "rank_0_0" / "model"
    artifact.parent.mkdir(parents=True)
    artifact.write_bytes(b"compiled")
    (root / "modelinfos.json").write_text("{}")


# --- stamp ---------------------------------------------------------------------------------------


def test_cache_stamp_names_isa_versions_weight_path_and_machine() -> None:
    import platform

    import torch
    from vllm.version import __version__ as vllm_version

    stamp = cache_stamp(["fma", "avx2", "fma"], "w4a16")
    assert stamp["isa_features"] == ["avx2", "fma"]
    assert stamp["torch"] == torch.__version__
    assert stamp["vllm"] == vllm_version
    assert stamp["weight_path"] == "w4a16"
    assert stamp["machine"] == platform.machine()


def test_fresh_root_is_stamped_and_not_reusable(tmp_path: Path, run_dir: Path) -> None:
    root = tmp_path / "vllm-cache"
    state = prepare_cache_root(root, _stamp())
    assert (state.reusable, state.reason) == (False, "fresh")
    assert json.loads((root / STAMP_FILE).read_text()) == _stamp()
    assert read_events(run_dir) == []  # nothing was there to miss; the worker counts its own miss


def test_same_stamp_is_reusable_and_keeps_the_cache(tmp_path: Path, run_dir: Path) -> None:
    root = tmp_path / "vllm-cache"
    prepare_cache_root(root, _stamp())
    _fill(root)
    state = prepare_cache_root(root, _stamp())
    assert (state.reusable, state.reason) == (True, "match")
    assert (root / "modelinfos.json").exists()
    assert read_events(run_dir) == []


@pytest.mark.parametrize(
    "key, value",
    [
        ("isa_features", ["avx2", "f16c", "fma"]),  # same CPU family without AVX-512
        ("torch", "2.12.0+cpu"),
        ("vllm", "0.31.0"),
        ("weight_path", "w4a16"),
        ("machine", "aarch64"),
    ],
)
def test_stamp_for_something_else_is_refused_counted_emptied_restamped(
    tmp_path: Path, run_dir: Path, key: str, value: Any
) -> None:
    root = tmp_path / "vllm-cache"
    prepare_cache_root(root, _stamp(**{key: value}))
    _fill(root)
    state = prepare_cache_root(root, _stamp())
    assert (state.reusable, state.reason, state.changed) == (False, "stamp_mismatch", (key,))
    assert sorted(p.name for p in root.iterdir()) == [STAMP_FILE]
    assert json.loads((root / STAMP_FILE).read_text()) == _stamp()
    assert [(e["event"], e["reason"]) for e in read_events(run_dir)] == [(MISS, "stamp_mismatch")]
    # and the next start on this host reuses it
    assert prepare_cache_root(root, _stamp()).reusable


def test_content_without_stamp_is_refused_counted_and_emptied(tmp_path: Path, run_dir: Path) -> None:
    root = tmp_path / "vllm-cache"
    _fill(root)
    state = prepare_cache_root(root, _stamp())
    assert (state.reusable, state.reason) == (False, "unstamped_content")
    assert sorted(p.name for p in root.iterdir()) == [STAMP_FILE]
    assert [e["reason"] for e in read_events(run_dir)] == ["unstamped_content"]


def test_unreadable_stamp_is_refused(tmp_path: Path, run_dir: Path) -> None:
    root = tmp_path / "vllm-cache"
    _fill(root)
    (root / STAMP_FILE).write_text('{"schema": 1, "isa_')  # cut short
    state = prepare_cache_root(root, _stamp())
    assert (state.reusable, state.reason) == (False, "unreadable_stamp")
    assert json.loads((root / STAMP_FILE).read_text()) == _stamp()


def test_emptying_removes_only_what_is_under_root(tmp_path: Path, run_dir: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not ours")
    root = tmp_path / "vllm-cache"
    _fill(root)
    (root / "linked-dir").symlink_to(outside, target_is_directory=True)
    (root / "linked-file").symlink_to(outside / "keep.txt")
    prepare_cache_root(root, _stamp())
    assert (outside / "keep.txt").read_text() == "not ours"
    assert root.is_dir() and sorted(p.name for p in root.iterdir()) == [STAMP_FILE]


# --- events --------------------------------------------------------------------------------------


def test_no_run_dir_means_no_events(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RUN_DIR.name, raising=False)
    assert record_event(HIT) is False
    assert read_events(tmp_path) == []


def test_events_are_json_lines_with_pid_and_time(run_dir: Path) -> None:
    before = time.time()
    assert record_event(MISS, reason="no_artifact")
    assert record_event(HIT)
    events = read_events(run_dir)
    assert [e["event"] for e in events] == [MISS, HIT]
    assert all(e["pid"] == os.getpid() and before <= e["time"] <= time.time() for e in events)
    assert events[0]["reason"] == "no_artifact"
    assert len((run_dir / compile_cache.EVENTS_FILE).read_text().splitlines()) == 2


def test_events_from_concurrent_processes_stay_whole_lines(run_dir: Path) -> None:
    writer = textwrap.dedent("""
        from spark_edge.runtime.compile_cache import record_event
        for i in range(300):
            assert record_event("compile_cache_miss", reason="x" * 300, i=i)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", writer], env=os.environ.copy()) for _ in range(4)]
    assert [p.wait(60) for p in procs] == [0, 0, 0, 0]
    lines = (run_dir / compile_cache.EVENTS_FILE).read_text().splitlines()
    assert len(lines) == 1200
    events = [json.loads(line) for line in lines]  # raises if any line was interleaved
    assert len({e["pid"] for e in events}) == 4


def test_reader_skips_a_line_cut_short(run_dir: Path) -> None:
    record_event(HIT)
    with open(run_dir / compile_cache.EVENTS_FILE, "a") as f:
        f.write('{"event": "compile_cache_mi')
    assert [e["event"] for e in read_events(run_dir)] == [HIT]


def test_unwritable_run_dir_does_not_raise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(RUN_DIR.name, str(blocker / "run"))
    assert record_event(HIT) is False


# --- post-import hook ----------------------------------------------------------------------------


@pytest.fixture
def scratch_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    name = f"se_scratch_{os.getpid()}_{time.monotonic_ns()}"
    (tmp_path / f"{name}.py").write_text("VALUE = 41\n\ndef answer():\n    return VALUE + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_callback_runs_right_after_a_later_import(scratch_module: str) -> None:
    import importlib
    import inspect

    seen: list[int] = []
    post_import.when_imported(scratch_module, lambda m: seen.append(m.VALUE))
    assert seen == [] and scratch_module in post_import.pending()
    module = importlib.import_module(scratch_module)
    assert seen == [41]
    assert scratch_module not in post_import.pending()
    assert module.answer() == 42
    assert "return VALUE + 1" in inspect.getsource(module.answer)  # the wrapped loader still serves source


def test_callback_runs_at_once_for_an_imported_module(scratch_module: str) -> None:
    import importlib

    module = importlib.import_module(scratch_module)
    seen: list[object] = []
    post_import.when_imported(scratch_module, seen.append)
    assert seen == [module]


def test_failing_callback_does_not_break_the_import(scratch_module: str) -> None:
    import importlib

    def broken(module: object) -> None:
        raise RuntimeError("patch target moved")

    post_import.when_imported(scratch_module, broken)
    assert importlib.import_module(scratch_module).VALUE == 41


# --- finalize_loading shim -----------------------------------------------------------------------


class _Forwarding:
    """Shaped like torch's BundledAOTAutogradSerializableCallable: attributes forward to a function."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fn, name)


def _artifact(compiled_fn: Any) -> SimpleNamespace:
    return SimpleNamespace(_artifacts=SimpleNamespace(compiled_fn=compiled_fn))


def test_shim_gives_a_no_op_finalize_loading_to_an_artifact_without_one() -> None:
    loaded = _artifact(_Forwarding(lambda *a: a))
    with pytest.raises(AttributeError, match="'function' object has no attribute 'finalize_loading'"):
        loaded._artifacts.compiled_fn.finalize_loading(None)  # what vLLM 0.32 hits on CPU
    assert fixes.give_finalize_loading(loaded) is True
    assert loaded._artifacts.compiled_fn.finalize_loading(object()) is None


def test_shim_leaves_an_existing_finalize_loading_alone() -> None:
    calls: list[object] = []

    class Finalizable:  # vLLM's VllmSerializableFunction (GPU path, or upstream fixed)
        def finalize_loading(self, vllm_config: object) -> None:
            calls.append(vllm_config)

    loaded = _artifact(Finalizable())
    assert fixes.give_finalize_loading(loaded) is False
    loaded._artifacts.compiled_fn.finalize_loading("cfg")
    assert calls == ["cfg"]


def test_shim_gives_up_quietly_on_objects_refusing_attributes() -> None:
    class Slotted:
        __slots__ = ()

        def __call__(self) -> None: ...

    assert fixes.give_finalize_loading(_artifact(Slotted())) is False
    assert fixes.give_finalize_loading(SimpleNamespace()) is False  # not an AOT artifact at all


def _kernel_import_error(path: Path) -> RuntimeError:
    """What Inductor raises for a kernel .so cut short: an ImportError, possibly wrapped."""
    try:
        try:
            raise ImportError(f"{path}: file too short", path=str(path))
        except ImportError as e:
            raise RuntimeError("InductorError: ImportError") from e
    except RuntimeError as wrapped:
        return wrapped


def test_damaged_kernel_under_the_inductor_cache_is_removed_so_it_is_rebuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "inductor_cache"
    kernel = cache / "br" / "cbr.main.so"
    kernel.parent.mkdir(parents=True)
    kernel.write_bytes(b"")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    error = _kernel_import_error(kernel)

    def load(*args: Any, **kwargs: Any) -> Any:
        raise error

    with pytest.raises(RuntimeError) as raised:
        fixes.fix_aot_cache_loading(load)(None)
    assert raised.value is error  # vLLM still sees the failure and counts a miss
    assert not kernel.exists()


def test_only_kernels_under_the_inductor_cache_are_ever_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, elsewhere = tmp_path / "inductor_cache", tmp_path / "site-packages" / "torch" / "lib.so"
    cache.mkdir()
    elsewhere.parent.mkdir(parents=True)
    elsewhere.write_bytes(b"not ours")
    assert fixes.unloadable_kernel(_kernel_import_error(elsewhere), str(cache)) is None
    assert fixes.unloadable_kernel(_kernel_import_error(cache / "x.py"), str(cache)) is None
    assert fixes.unloadable_kernel(_kernel_import_error(cache / "a.so"), None) is None
    assert fixes.unloadable_kernel(ValueError("unrelated"), str(cache)) is None
    assert fixes.unloadable_kernel(_kernel_import_error(cache / "a.so"), str(cache)) == cache / "a.so"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))

    def load(*args: Any, **kwargs: Any) -> Any:
        raise _kernel_import_error(elsewhere)

    with pytest.raises(RuntimeError):
        fixes.fix_aot_cache_loading(load)(None)
    assert elsewhere.read_bytes() == b"not ours"


def _double_silu(x: Any) -> Any:
    import torch

    return torch.nn.functional.silu(x) * 2 + 1


@pytest.fixture(scope="module")
def real_aot_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real torch AOT artifact of the kind vLLM saves on CPU (torch wraps AOTAutograd output
    in BundledAOTAutogradSerializableCallable; aot_eager gives the same wrapper as inductor
    without a C++ compile)."""
    import torch

    with torch._dynamo.config.patch(enable_aot_compile=True):
        compiled = torch.compile(_double_silu, fullgraph=True, dynamic=False, backend="aot_eager")
        artifact = compiled.aot_compile(((torch.randn(4, 8),), {}))
    path = tmp_path_factory.mktemp("aot") / "model"
    artifact.save_compiled_function(str(path))
    return path


@pytest.fixture(scope="module")
def fake_compiled_model() -> SimpleNamespace:
    """What `_try_load_aot_compiled_fn` reads from the model it loads for."""
    from vllm.config import VllmConfig

    config = VllmConfig()
    return SimpleNamespace(
        vllm_config=config, compilation_config=config.compilation_config, _is_encoder=False, forward=_double_silu
    )


@pytest.fixture
def vllm_log() -> Iterator[list[str]]:
    records: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("vllm.compilation.decorators")
    old_level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(old_level)


@pytest.fixture
def fixed_decorators() -> Any:
    fixes.apply_runtime_fixes()
    from vllm.compilation import decorators

    return decorators


def test_apply_is_idempotent_and_patches_vllm_when_imported(fixed_decorators: Any) -> None:
    import torch

    loader = torch.compiler.load_compiled_function
    try_load = fixed_decorators._try_load_aot_compiled_fn
    assert getattr(loader, fixes._MARK) == "aot_cache_loading"
    assert getattr(try_load, fixes._MARK) == "compile_cache_accounting"
    fixes._applied = False  # as if a second copy of the module applied them again
    fixes.apply_runtime_fixes()
    fixes._patch_compile_cache_accounting(fixed_decorators)
    assert torch.compiler.load_compiled_function is loader
    assert fixed_decorators._try_load_aot_compiled_fn is try_load


def test_vllm_loads_a_real_cpu_aot_artifact_only_with_the_shim(
    fixed_decorators: Any,
    real_aot_artifact: Path,
    fake_compiled_model: SimpleNamespace,
    vllm_log: list[str],
    run_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    patched = torch.compiler.load_compiled_function
    monkeypatch.setattr(torch.compiler, "load_compiled_function", patched.__wrapped__)
    assert fixed_decorators._try_load_aot_compiled_fn(fake_compiled_model, str(real_aot_artifact)) is None
    assert any("'function' object has no attribute 'finalize_loading'" in m for m in vllm_log), (
        "vLLM/torch no longer fail here: the finalize_loading shim can be removed"
    )

    monkeypatch.setattr(torch.compiler, "load_compiled_function", patched)
    loaded = fixed_decorators._try_load_aot_compiled_fn(fake_compiled_model, str(real_aot_artifact))
    assert loaded is not None
    assert any("Directly load AOT compilation" in m for m in vllm_log)
    x = torch.randn(4, 8)
    assert torch.allclose(loaded(x), _double_silu(x))
    assert [(e["event"], e.get("reason")) for e in read_events(run_dir)] == [(MISS, "load_failed"), (HIT, None)]


@pytest.mark.parametrize("keep_bytes", [0, 200])
def test_truncated_artifact_is_a_counted_miss(
    fixed_decorators: Any,
    real_aot_artifact: Path,
    fake_compiled_model: SimpleNamespace,
    vllm_log: list[str],
    run_dir: Path,
    tmp_path: Path,
    keep_bytes: int,
) -> None:
    truncated = tmp_path / "model"
    truncated.write_bytes(real_aot_artifact.read_bytes()[:keep_bytes])
    assert fixed_decorators._try_load_aot_compiled_fn(fake_compiled_model, str(truncated)) is None
    assert any("Compiling model again due to a load failure" in m for m in vllm_log)
    if keep_bytes == 0:
        assert any("Compile cache file corrupted." in m for m in vllm_log)  # vLLM's EOFError wording
    assert [(e["event"], e["reason"]) for e in read_events(run_dir)] == [(MISS, "load_failed")]


def test_missing_artifact_is_a_counted_miss(
    fixed_decorators: Any, fake_compiled_model: SimpleNamespace, run_dir: Path, tmp_path: Path
) -> None:
    assert fixed_decorators._try_load_aot_compiled_fn(fake_compiled_model, str(tmp_path / "none")) is None
    assert [(e["event"], e["reason"]) for e in read_events(run_dir)] == [(MISS, "no_artifact")]


def test_a_raising_load_is_counted_and_reraised(run_dir: Path, tmp_path: Path) -> None:
    def forced(model: object, aot_compilation_path: str) -> None:  # VLLM_FORCE_AOT_LOAD re-raises
        raise EOFError

    wrapped = fixes.count_compile_cache_loads(forced)
    assert fixes.count_compile_cache_loads(wrapped) is wrapped
    with pytest.raises(EOFError):
        wrapped(None, aot_compilation_path=str(tmp_path / "model"))
    assert [(e["event"], e["reason"]) for e in read_events(run_dir)] == [(MISS, "no_artifact")]


# --- memory release ------------------------------------------------------------------------------

_FRAGMENT_AND_FREE = textwrap.dedent("""
    import json, os, sys
    from spark_edge.probe.procfs import rss_anon_bytes
    from spark_edge.runtime.memory import release_free_memory
    # 2 KiB blocks come from glibc's heap (above pymalloc's 512 B, below the mmap threshold);
    # keeping every 64th pins the heap top, so free() alone cannot give the memory back
    blocks = [bytearray(2048) for _ in range(150_000)]
    keep = blocks[::64]
    del blocks
    before = rss_anon_bytes(os.getpid())
    release = release_free_memory("test")
    after = rss_anon_bytes(os.getpid())
    print(json.dumps({"before": before, "after": after, "release": release is not None}))
""")


def _run_fragmenter(env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", _FRAGMENT_AND_FREE], env=env, capture_output=True, text=True, timeout=120, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif("malloc_trim" not in releasers(), reason="no glibc malloc_trim in this process")
def test_release_returns_freed_heap_to_the_os() -> None:
    result = _run_fragmenter({**os.environ, RELEASE_MEMORY.name: "1"})
    assert result["release"]
    assert result["before"] - result["after"] > 150 << 20, result  # ~290 MiB were freed


def test_release_is_off_with_env_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RELEASE_MEMORY.name, "0")
    assert release_free_memory("test") is None
    result = _run_fragmenter({**os.environ, RELEASE_MEMORY.name: "0"})
    assert not result["release"]
    assert result["before"] - result["after"] < 32 << 20, result


def test_release_is_a_no_op_without_an_allocator_to_ask(monkeypatch: pytest.MonkeyPatch) -> None:
    import spark_edge.runtime.memory as memory

    monkeypatch.setattr(memory, "_global_symbol", lambda name: None)  # musl: no malloc_trim
    assert memory.releasers() == {}
    assert memory.release_free_memory("test") is None


def test_wrapped_method_releases_after_returning(monkeypatch: pytest.MonkeyPatch) -> None:
    released: list[str] = []
    monkeypatch.setattr(fixes, "release_free_memory", released.append)

    class Worker:
        def load_model(self, *, load_dummy_weights: bool = False) -> str:
            assert released == []
            return f"loaded dummy={load_dummy_weights}"

    fixes._wrap_method(Worker, "load_model", "model load")
    fixes._wrap_method(Worker, "load_model", "model load")  # idempotent
    assert Worker().load_model(load_dummy_weights=True) == "loaded dummy=True"
    assert released == ["model load"]


def test_cpu_worker_load_and_warm_up_are_wrapped_when_vllm_imports_them() -> None:
    # A fresh process: the CPU worker is not imported yet when the fixes are applied (as in
    # the plugin), and vLLM's import of it patches torch APIs we keep out of this process.
    check = textwrap.dedent("""
        import sys
        from spark_edge.runtime import fixes
        fixes.apply_runtime_fixes()
        assert "vllm.v1.worker.cpu_worker" not in sys.modules
        from vllm.v1.worker import cpu_worker
        from vllm.v1.worker.gpu_worker import Worker
        load_model = cpu_worker.CPUWorker.load_model
        warm_up = cpu_worker.CPUModelRunner.warming_up_model
        assert getattr(load_model, fixes._MARK) == "release_memory"
        # fix 9 maps the weights first (runtime/mapped_weights.py), then fix 3 releases the copies
        assert getattr(load_model.__wrapped__, fixes._MARK) == "mapped_weights"
        assert load_model.__wrapped__.__wrapped__ is Worker.load_model
        assert getattr(warm_up, fixes._MARK) == "release_memory"
        assert warm_up.__wrapped__.__qualname__ == "CPUModelRunner.warming_up_model"
        fixes._patch_cpu_worker_memory_release(cpu_worker)
        assert cpu_worker.CPUWorker.load_model is load_model
        print("WRAPPED")
    """)
    run = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "WRAPPED" in run.stdout, run.stderr[-3000:]


# --- single-rank gloo groups share one device: one polling thread, not one per group ---------------

_GLOO_GROUPS = textwrap.dedent("""
    import os, sys
    import torch
    from spark_edge.runtime import fixes
    if sys.argv[1] == "fixed":
        fixes.apply_runtime_fixes()
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    with set_current_vllm_config(VllmConfig()):
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                        distributed_init_method="tcp://127.0.0.1:" + sys.argv[2])
        ps.initialize_model_parallel(1, 1)
        # what vLLM runs on these groups at world size 1 reaches torch: barriers, object collectives
        world = ps.get_world_group()
        world.barrier()
        assert world.broadcast_object({"step": 3}) == {"step": 3}
        out = [None]
        torch.distributed.all_gather_object(out, ("rank", 0), group=ps.get_tp_group().cpu_group)
        assert out == [("rank", 0)], out
        t = torch.arange(4.0)
        torch.distributed.all_reduce(t, group=ps.get_tp_group().device_group)
        assert t.tolist() == [0.0, 1.0, 2.0, 3.0], t
        task = lambda tid, name: open(f"/proc/self/task/{tid}/{name}").read().strip()
        loops = [tid for tid in os.listdir("/proc/self/task") if task(tid, "comm") == "gloo_tcp_loop"]
        groups = len(torch.distributed.distributed_c10d._world.pg_map)
        # the timer slack each loop thread sleeps with, and this (creating) thread's own
        slack = lambda tid: int(open(f"/proc/{tid}/timerslack_ns").read())  # proc(5): a thread's id works too
        slacks = sorted({slack(tid) for tid in loops})
        own = slack(os.getpid())
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()
    print("GLOO", len(loops), groups, own, *slacks)
""")


def _gloo_loops(mode: str) -> tuple[int, int, int, list[int]]:
    """Loop threads, groups, the creating thread's timer slack and the loop threads' slacks."""
    from spark_edge.serving.server_process import free_port

    run = subprocess.run(
        [sys.executable, "-c", _GLOO_GROUPS, mode, str(free_port())], capture_output=True, text=True, timeout=300
    )
    line = next((x for x in run.stdout.splitlines() if x.startswith("GLOO ")), None)
    assert run.returncode == 0 and line, run.stderr[-3000:]
    loops, groups, own, *slacks = map(int, line.split()[1:])
    return loops, groups, own, slacks


def test_single_rank_gloo_groups_share_one_sleepy_thread_and_still_work() -> None:
    fixed_loops, groups, own, fixed_slacks = _gloo_loops("fixed")
    plain_loops, _, plain_own, plain_slacks = _gloo_loops("plain")
    assert groups > 1
    assert fixed_loops == 1, f"{fixed_loops} gloo loop threads for {groups} groups"
    assert plain_loops > 1  # what the fix corrects is still there without it (else: retire the fix)
    # the loop's 10 ms poll may be deferred by a second; nothing else in the process changes its slack
    assert fixed_slacks == [fixes.IDLE_LOOP_SLACK_NS]
    assert plain_slacks == [plain_own] and own == plain_own


def test_groups_of_several_ranks_are_built_as_torch_builds_them() -> None:
    calls: list[tuple[Any, ...]] = []

    class Gloo:
        def __init__(self, *args: Any) -> None:
            calls.append(args)

        @staticmethod
        def create_default_device() -> str:
            return "device"

    from datetime import timedelta

    shared = fixes._shared_device_gloo(Gloo)
    shared("store", 0, 2, timedelta(seconds=5))
    assert calls == [("store", 0, 2, timedelta(seconds=5))]


def test_uvicorn_ticks_once_a_second_refreshing_the_date_header_each_time() -> None:
    import asyncio

    import uvicorn

    fixes._patch_uvicorn_tick(__import__("uvicorn.server", fromlist=["Server"]))
    server = uvicorn.Server(uvicorn.Config(app=None))
    assert getattr(uvicorn.Server.main_loop, fixes._MARK) == "uvicorn_tick"
    ticks: list[int] = []
    on_tick = server.on_tick

    async def counting_tick(counter: int) -> bool:
        ticks.append(counter)
        return await on_tick(counter) or len(ticks) == 3

    server.on_tick = counting_tick  # type: ignore[method-assign]
    server.server_state = uvicorn.server.ServerState()
    server.config.load()
    start = time.monotonic()
    asyncio.run(server.main_loop())
    elapsed = time.monotonic() - start
    assert ticks == [0, 10, 20]  # each a multiple of ten: the Date header is refreshed on every tick
    assert elapsed >= 1.8, elapsed  # two sleeps of a second between the three ticks, not of 0.1 s
    assert any(name == b"date" for name, _ in server.server_state.default_headers)
    server.should_exit = True
    assert asyncio.run(server.on_tick(30)) is True


# --- 10. a text model's tokenizer is not loaded a second time to find its chat template ---


def _folder(tmp_path: Path, config: dict, **files: str) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    for name, text in files.items():
        (folder / name.replace("__", ".")).write_text(text)
    return folder


def test_a_text_model_folder_has_no_processor(tmp_path: Path) -> None:
    assert fixes.has_no_processor(_folder(tmp_path, {"model_type": "llama"}, tokenizer_config__json="{}"))


@pytest.mark.parametrize(
    ("config", "files"),
    [
        ({"model_type": "llama"}, {"preprocessor_config__json": "{}"}),  # an image processor
        ({"model_type": "llama"}, {"processor_config__json": "{}"}),
        ({"model_type": "llama"}, {"tokenizer_config__json": '{"processor_class": "LlavaProcessor"}'}),
        ({"model_type": "llama", "processor_class": "X"}, {}),
        ({"model_type": "llava"}, {}),  # transformers maps the model type to a processor
    ],
)
def test_anything_autoprocessor_could_build_from_keeps_vllms_lookup(
    tmp_path: Path, config: dict, files: dict[str, str]
) -> None:
    folder = _folder(tmp_path, config, **files)
    assert not fixes.has_no_processor(folder)
    calls = []
    lookup = fixes.skip_absent_processor(lambda tokenizer, **kw: calls.append(tokenizer) or "template")
    assert lookup(SimpleNamespace(name_or_path=str(folder)), revision=None) == "template"
    assert calls


def test_the_lookup_answers_none_for_a_text_model_without_loading_anything(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"model_type": "qwen2"})
    lookup = fixes.skip_absent_processor(lambda tokenizer, **kw: pytest.fail("loaded a processor"))
    assert lookup(SimpleNamespace(name_or_path=str(folder)), revision=None) is None
    # a hub name (no local folder) runs vLLM's lookup
    assert fixes.skip_absent_processor(lambda tokenizer, **kw: "t")(SimpleNamespace(name_or_path="org/m")) == "t"


def test_vllms_renderer_gets_the_lookup_when_imported() -> None:
    from vllm.renderers import hf

    fixes.apply_runtime_fixes()
    assert fixes._is_ours(hf._try_get_processor_chat_template)


@pytest.mark.parametrize(("bits", "listed", "emitted"), [(512, 256, "NEON"), (256, 256, "SVE"), (128, 128, "SVE")])
def test_inductor_takes_neon_where_it_has_no_sve_code_for_the_cpus_length(
    monkeypatch: pytest.MonkeyPatch, bits: int, listed: int, emitted: str
) -> None:
    """torch lists VecSVE(256) for a 512-bit SVE CPU (qemu's default arm64 CPU: garbage from compiled graphs):
    NEON there; a CPU whose length torch has SVE code for keeps it; so does an x86 list, where nothing is SVE."""
    from torch._inductor.cpu_vec_isa import VecAVX2, VecSVE

    monkeypatch.setattr(fixes, "sve_vector_bits", lambda: bits)
    wrapped = fixes.neon_where_sve_length_is_unknown(lambda: [VecSVE(listed)])
    assert [type(isa).__name__ for isa in wrapped()] == [f"Vec{emitted}"]
    assert fixes.neon_where_sve_length_is_unknown(lambda: [VecAVX2()])() == [VecAVX2()]


def test_the_inductor_sve_patch_wraps_once() -> None:
    module = SimpleNamespace(valid_vec_isa_list=lambda: [])
    fixes._patch_inductor_sve_length(module)
    first = module.valid_vec_isa_list
    fixes._patch_inductor_sve_length(module)
    assert module.valid_vec_isa_list is first and fixes._is_ours(first)
