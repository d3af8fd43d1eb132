"""A request body over the size any request that fits the context can need is refused with
413 before it is read whole or parsed, so a huge body costs the server no memory."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse

from frontend.openai_server.errors import ApiError

MAX_BYTES_PER_TOKEN = 64
"""A generous bound on what one prompt token costs in a JSON body: an id is at most 11 bytes,
and text that json.dumps escapes (\\uXXXX, 6 bytes a character) rarely passes 12 a token."""
JSON_ROOM_BYTES = 1 << 20
"""Room for everything else a body holds: parameters, stop strings, chat roles."""


def default_max_request_bytes(max_model_len: int) -> int:
    """The largest body a request that fits the context can need, with room to spare."""
    return MAX_BYTES_PER_TOKEN * max_model_len + JSON_ROOM_BYTES


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` is answered 413 before it is read
    whole or parsed. A declared Content-Length is checked first; a chunked body is counted
    while it arrives. The body read is handed on to the app, then the connection's later
    messages (a disconnect) as they come."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._refuse(scope, receive, send, declared.isdigit())
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before its body arrived
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(scope, receive, send, True)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, delivered = b"".join(chunks), False

        async def replay() -> dict:
            nonlocal delivered
            if delivered:
                return await receive()
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, scope: dict, receive: Callable, send: Callable,
                      too_large: bool) -> None:
        if too_large:
            err = ApiError(413, f"request body exceeds {self.max_bytes} bytes (the most a "
                           "request that fits max_model_len needs)", code="request_too_large")
        else:
            err = ApiError(400, "Content-Length is not a number")
        # The unread body is not drained: the server closes the connection instead.
        response = JSONResponse(err.body(), status_code=err.status,
                                headers={"Connection": "close"})
        await response(scope, receive, send)
