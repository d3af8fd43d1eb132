"""Stopping the HTTP server without cutting answers off mid-way.

On SIGTERM (or Ctrl-C, or the engine's death) uvicorn stops taking connections and waits for
the requests in flight. Those that finish within the grace period are answered as usual; the
rest are then answered with a 503 `shutting_down` error (an SSE error event and `[DONE]` on a
stream) and their engine requests aborted, before uvicorn would cancel them into a bare
"Internal Server Error" or a stream cut off without an end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from frontend.openai_server.errors import ApiError

GRACE_S = 5.0
"""How long requests in flight may run on once the server is told to stop."""
_UVICORN_SLACK_S = 2.0
"""uvicorn cancels what still runs this much after the grace: time to send the 503s."""
_POLL_S = 0.25


class Stoppable(Protocol):
    should_exit: bool


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down; retry the request",
                    type="server_error", code="shutting_down")


class Drain:
    """`over` is set `grace_s` after the server began to stop; handlers race their work
    against it (see streaming.answer)."""

    def __init__(self, grace_s: float = GRACE_S) -> None:
        self.grace_s = grace_s
        self.over = asyncio.Event()
        self._server: Stoppable | None = None

    def attach(self, server: Stoppable) -> None:
        """The server whose stop `stopping` reports."""
        self._server = server

    def stopping(self) -> bool:
        """Told to stop (SIGTERM sets uvicorn's flag in the signal handler itself): /health
        says so from that moment, not from the next tick of uvicorn's loop."""
        return self._server is not None and self._server.should_exit

    @property
    def uvicorn_timeout_s(self) -> float:
        """uvicorn's `timeout_graceful_shutdown` to go with this grace."""
        return self.grace_s + _UVICORN_SLACK_S

    async def watch(self, server: Stoppable,
                    engine_alive: Callable[[], bool] | None = None) -> None:
        """Run beside `server`: stop it when the engine dies, and end the grace after a stop."""
        while not server.should_exit:
            if engine_alive is not None and not engine_alive():
                server.should_exit = True
            await asyncio.sleep(_POLL_S)
        await asyncio.sleep(self.grace_s)
        self.over.set()
