"""vLLM's engine core on a thread of the API server's process: the `single` process layout.

vLLM 0.32's AsyncLLM always starts its engine core in a process of its own (`make_client` refuses
"EngineCore in asyncio without multiprocessing"), which imports torch and vLLM a second time: on a
135M model that second runtime is most of the server's memory and half of its start. Here the same
engine core runs on one thread of the server process, and nothing else of vLLM changes:

- `ThreadEngineCore` is vLLM's `EngineCoreProc` (its busy loop, request handling, drain on shutdown,
  utility calls) without the ZMQ handshake and socket threads: its input queue is filled by the
  client directly, and its output queue hands each item to the event loop's thread.
- `AsyncInprocClient` is vLLM's `AsyncMPClient` (every `*_async` method AsyncLLM calls) with the
  transport replaced: requests are put on the engine's input queue (preprocessed on the event loop,
  as vLLM's input socket thread does beside the forward pass), outputs and utility results arrive
  through `loop.call_soon_threadsafe`.

The engine thread builds the engine core itself and steps it: vLLM's CPU worker binds the OpenMP team
of the thread that initialises it, so the thread that loads the model must be the thread that runs it.
The event loop keeps the main thread: the engine releases the GIL inside every torch op, and the loop
needs it only to tokenize, detokenize and write responses.

Installed by runtime/fixes.py (fix 8) when the process layout is `single`.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import queue
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType
from vllm.v1.engine.core import EngineCore, EngineCoreProc, EngineShutdownState
from vllm.v1.engine.core_client import AsyncMPClient, _process_utility_output
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.request import RequestStatus

from spark_edge.environment import STUCK_STEP_TIMEOUT
from spark_edge.errors import ENGINE_START_FAILED  # serve maps it to exit 7

_LOG = logging.getLogger("vllm.spark_edge.inproc_engine")

# After a drain's timeout: every request still in the engine is aborted, then this long to stop.
ABORT_GRACE_S = 10.0
WATCH_INTERVAL_S = 1.0
_ABORT_ALL = "spark-edge:abort-all"  # a request type of our own on the engine's input queue


class _ToEventLoop:
    """The engine core's output queue: each item goes to `deliver` on the event loop's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, deliver: Callable[[Any], None]):
        self.loop, self.deliver = loop, deliver

    def put_nowait(self, item: Any) -> None:
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.deliver, item)


class ThreadEngineCore(EngineCoreProc):
    """EngineCoreProc's loop over in-process queues (no sockets, no handshake, one engine, no DP)."""

    def __init__(self, vllm_config: Any, executor_class: type, log_stats: bool, output_queue: _ToEventLoop):
        # what EngineCoreProc.__init__ sets before and around EngineCore.__init__, for one local engine
        self.input_queue: queue.Queue[tuple[Any, Any]] = queue.Queue()
        self.output_queue = output_queue  # type: ignore[assignment]
        self.engine_index = 0
        self.engines_running = False
        self.shutdown_state = EngineShutdownState.RUNNING
        self.tensor_ipc_receiver = None
        self.has_coordinator = False
        self.frontend_stats_publish_address = None
        self.publish_dp_lb_stats = False
        self.last_counts = (0, 0)
        self.process_input_queue_block = True
        self.enable_fault_tolerance = False
        executor_failed = (EngineCoreRequestType.EXECUTOR_FAILED, b"")
        EngineCore.__init__(
            self, vllm_config, executor_class, log_stats, lambda: self.input_queue.put_nowait(executor_failed)
        )

    def _handle_client_request(self, request_type: Any, request: Any) -> None:
        if request_type == _ABORT_ALL:
            self._send_abort_outputs(self.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED))
            return
        super()._handle_client_request(request_type, request)

    def _send_engine_dead(self) -> None:
        self.output_queue.put_nowait(EngineCoreProc.ENGINE_CORE_DEAD)

    step_started: float | None = None  # when the step in progress began (read by the client's watchdog)

    def _process_engine_step(self) -> bool:
        self.step_started = time.monotonic()
        try:
            return super()._process_engine_step()
        finally:
            self.step_started = None


def _name_os_thread(name: str) -> None:
    """The kernel's name of the calling thread (top -H, /proc/PID/task/TID/comm): Python 3.11's thread names
    stay in Python. Best effort: prctl is Linux's."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass


_PR_SET_NAME = 15


class _Resources:
    """What AsyncLLM and AsyncMPClient read of MPClient's BackgroundResources."""

    engine_dead = False
    output_queue_task = None


async def _sent() -> None:
    """`_send_input` returns an awaitable; putting on a queue is done when it returns."""


class AsyncInprocClient(AsyncMPClient):
    """AsyncMPClient's interface to an engine core on a thread of this process (module docstring)."""

    def __init__(
        self,
        vllm_config: Any,
        executor_class: type,
        log_stats: bool,
        client_addresses: dict[str, Any] | None = None,
        client_count: int = 1,
        client_index: int = 0,
        renderer: Any = None,
    ):
        if client_addresses or client_count != 1:
            raise ValueError("the single process layout runs one engine for one API server")
        # not MPClient.__init__: it binds sockets and starts engine processes
        self.vllm_config = vllm_config
        self._renderer = renderer
        self._effective_attention_block_sizes: set[int | None] = set()
        self._kv_event_sources: dict = {}
        self.resources = _Resources()
        self.engines_running = False
        self.stats_update_address = None
        self.client_count, self.client_index = 1, 0
        self.engine_ranks_managed = [0]
        self.core_engine = (0).to_bytes(2, "little")
        self.core_engines = [self.core_engine]
        self.outputs_queue: asyncio.Queue[EngineCoreOutputs | Exception] = asyncio.Queue()
        self.utility_results: dict[int, asyncio.Future] = {}
        self._engine_status: dict[int, dict] = {}
        self.death: str | None = None  # why the engine thread ended, once it has
        self._stopped = False
        self._loop = asyncio.get_running_loop()
        self.core: ThreadEngineCore | None = None
        started = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(executor_class, log_stats, started), name="EngineCore", daemon=True
        )
        self._thread.start()
        started.wait()  # the event loop waits for the model, as vLLM's handshake with an engine process does
        if self.core is None:
            raise RuntimeError(f"{ENGINE_START_FAILED} (in this process: {self.death}). See root cause above.")
        self._start_mm_warmup()
        self._watchdog = self._loop.create_task(self._watch_for_a_stuck_step(), name="EngineCoreWatchdog")

    # --- the engine thread -------------------------------------------------------------------------

    def _run(self, executor_class: type, log_stats: bool, started: threading.Event) -> None:
        _name_os_thread("EngineCore")
        try:
            self.core = ThreadEngineCore(
                self.vllm_config, executor_class, log_stats, _ToEventLoop(self._loop, self._deliver)
            )
        except BaseException as exc:
            _LOG.exception("EngineCore failed to start.")
            self.death = repr(exc)
            return
        finally:
            started.set()
        try:
            self.core.run_busy_loop()
        except SystemExit:
            _LOG.info("[shutdown] EngineCore: exiting busy loop")
        except BaseException as exc:
            _LOG.exception("EngineCore encountered a fatal error.")
            self.death = f"the engine thread failed: {exc!r}"
            self.core._send_engine_dead()
        finally:
            self.core.shutdown()

    # --- the event loop's side ---------------------------------------------------------------------

    def _deliver(self, item: Any) -> None:
        """An item of the engine's output queue, on the event loop: what AsyncMPClient's socket task does."""
        if item == EngineCoreProc.ENGINE_CORE_DEAD:
            self._engine_died("the engine thread ended")
            return
        _, outputs = item
        if outputs.utility_output:
            _process_utility_output(outputs.utility_output, self.utility_results)
        elif outputs.outputs or outputs.scheduler_stats:
            self.outputs_queue.put_nowait(outputs)

    def _engine_died(self, why: str) -> None:
        """What an engine process's death does to AsyncMPClient: engine_dead, and an error to the output
        handler (requests in flight fail, /health answers 503, vLLM's watchdog stops the server)."""
        if not self.resources.engine_dead:
            self.death = self.death or why
            self.resources.engine_dead = True
            self.outputs_queue.put_nowait(EngineDeadError())

    async def _watch_for_a_stuck_step(self) -> None:
        limit = float(STUCK_STEP_TIMEOUT.get() or 0)
        while limit > 0 and not self.resources.engine_dead and not self._stopped:
            await asyncio.sleep(WATCH_INTERVAL_S)
            started = self.core.step_started if self.core is not None else None
            if started is not None and time.monotonic() - started > limit:
                _LOG.error("EngineCore: one step has not returned in %.0f s; the engine is stuck", limit)
                self._engine_died(f"the engine thread has been stuck in one step for more than {limit:.0f} s")

    def _ensure_output_queue_task(self) -> None:
        """Outputs arrive through `_deliver`: no socket to read."""

    def _send_input(self, request_type: Any, request: Any, engine: Any = None) -> Awaitable[None]:
        self.ensure_alive()
        assert self.core is not None
        if request_type == EngineCoreRequestType.ADD:
            assert isinstance(request, EngineCoreRequest)
            try:
                request = self.core.preprocess_add_request(request)
            except Exception:
                self.core._handle_request_preproc_error(request)
                return _sent()
        elif request_type == EngineCoreRequestType.ABORT:
            self.core.aborts_queue.put_nowait(request)  # as vLLM's input thread: eager, and in order below
        self.core.input_queue.put_nowait((request_type, request))
        return _sent()

    async def _call_utility_async(self, method: str, *args: Any, engine: Any = None) -> Any:
        self.ensure_alive()
        assert self.core is not None
        call_id = uuid.uuid1().int >> 64  # as AsyncMPClient numbers its calls
        future = self._loop.create_future()
        self.utility_results[call_id] = future
        self.core.input_queue.put_nowait((EngineCoreRequestType.UTILITY, (0, call_id, method, args)))
        return await future

    def shutdown(self, timeout: float | None = None) -> None:
        """As an engine process is stopped: a drain of `timeout` seconds (vLLM's --shutdown-timeout; its loop
        aborts at once for 0), then what is left aborted. Called off the event loop (vLLM runs it in an
        executor), so outputs keep flowing while the engine drains."""
        if self._stopped:
            return
        self._stopped = True
        core = self.core
        if core is None or not self._thread.is_alive() or self.resources.engine_dead:
            return  # nothing to drain; a stuck thread is left to the process's exit
        if core.shutdown_state == EngineShutdownState.RUNNING:
            core.shutdown_state = EngineShutdownState.REQUESTED
        core.input_queue.put_nowait((EngineCoreRequestType.WAKEUP, None))
        self._thread.join(timeout)
        if self._thread.is_alive():
            _LOG.info("[shutdown] EngineCore: drain timed out; aborting the requests left")
            core.input_queue.put_nowait((_ABORT_ALL, None))
            self._thread.join(ABORT_GRACE_S)
