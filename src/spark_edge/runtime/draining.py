"""While SIGTERM drains the in-flight requests, a new request gets 503, not vLLM's 500.

With `--shutdown-timeout N` (serve passes it), vLLM 0.32 answers SIGTERM by stopping its
engine client: the API server's tokenizer pool is shut down first, then the engine finishes
the requests it has, for at most N seconds. A request arriving meanwhile fails with HTTP 500
("cannot schedule new futures after shutdown"), which reads as a server bug. fixes.py marks the
moment the drain begins (AsyncLLM.shutdown); from then on this middleware, which serve hands to
vLLM with --middleware, answers every request but /metrics with 503, `Retry-After` and
`Connection: close`: a client or load balancer retries on another instance, and a readiness
probe on /health fails at once. Requests already in flight are not touched.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from typing import Any

MIDDLEWARE = "spark_edge.runtime.draining.refuse_while_draining"  # vLLM's --middleware import path

_draining = threading.Event()


def begin_draining() -> None:
    _draining.set()


def is_draining() -> bool:
    return _draining.is_set()


async def refuse_while_draining(request: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
    if not _draining.is_set() or request.url.path == "/metrics":
        return await call_next(request)
    from starlette.responses import JSONResponse  # only the API server gets here: starlette is there

    error = {
        "message": "the server is shutting down; retry on another instance",
        "type": "ServiceUnavailable",
        "param": None,
        "code": 503,
    }
    return JSONResponse({"error": error}, status_code=503, headers={"Retry-After": "5", "Connection": "close"})
