"""A request body over the limit gets 413 before it is read, so a 200 MB POST costs the server nothing.

vLLM reads a request's whole body into memory before it looks at it, and sets no limit of its own.
This ASGI middleware, which serve hands to vLLM with --middleware (vLLM adds a class with
`app.add_middleware`, outside its API-key check), answers 413 at once when Content-Length says the
body is too large, and stops a body sent without a length (chunked) as soon as it passes the limit.
The limit reaches the API server through the environment, as serve runs it in this process.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from spark_edge.environment import MAX_REQUEST_BYTES

MIDDLEWARE = "spark_edge.serving.request_limits.BodySizeLimit"  # vLLM's --middleware import path
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20  # a 2048-token context is ~10 KiB of text; chat with images is not served

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


async def _reply(send: Send, status: int, message: str) -> None:
    body = json.dumps(
        {
            "error": {
                "message": message,
                "type": "RequestTooLarge" if status == 413 else "BadRequest",
                "param": None,
                "code": status,
            }
        }
    ).encode()
    # Connection: close: what the client has not sent yet is never read
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _content_length(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return value.decode("latin-1")
    return None


class BodySizeLimit:
    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app
        self.limit = int(MAX_REQUEST_BYTES.get() or DEFAULT_MAX_REQUEST_BYTES)

    def _too_large(self, size: str) -> str:
        return f"the request body ({size} bytes) is larger than this server accepts ({self.limit} bytes)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = _content_length(scope)
        if length is not None:
            if not length.isdigit():
                return await _reply(send, 400, f"Content-Length {length!r} is not a number of bytes")
            if int(length) > self.limit:
                return await _reply(send, 413, self._too_large(length))
        seen = 0
        started = replied = False

        async def counted_receive() -> Message:
            # past the limit: answer 413 now, and tell the app the client is gone (what it sends is dropped)
            nonlocal seen, replied
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit and not started:
                    if not replied:
                        replied = True
                        await _reply(send, 413, self._too_large(f"more than {seen}"))
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if replied:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, counted_receive, guarded_send)
