"""Run an app under uvicorn in a background thread, on 127.0.0.1 and a free port."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager

import uvicorn
from fastapi import FastAPI

AppFactory = Callable[[], AbstractAsyncContextManager[FastAPI]]


@contextlib.contextmanager
def running_server(make_app: AppFactory, timeout: float = 30.0,
                   beside: Callable[[uvicorn.Server], Awaitable[None]] | None = None,
                   graceful_s: float = 2.0) -> Iterator[str]:
    """Yield the base URL (http://127.0.0.1:PORT) of `make_app()` served in its own loop.

    The app is built inside the server's event loop, because an AsyncClient belongs to the
    loop it was created in. `beside(server)`, when given, runs as a task beside the server
    (as the launcher runs its drain watch); uvicorn gives requests `graceful_s` to finish.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    holder: dict[str, object] = {}

    async def main() -> None:
        async with make_app() as app:
            config = uvicorn.Config(app, log_level="warning", lifespan="off",
                                    timeout_graceful_shutdown=graceful_s)
            server = uvicorn.Server(config)
            holder["server"] = server
            task = asyncio.ensure_future(beside(server)) if beside is not None else None
            try:
                await server.serve(sockets=[sock])
            finally:
                if task is not None:
                    task.cancel()

    def thread_main() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:  # surfaced by the waiting test
            holder["error"] = exc

    thread = threading.Thread(target=thread_main, name="http-test-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not getattr(holder.get("server"), "started", False):
        if "error" in holder or not thread.is_alive():
            raise RuntimeError(f"server failed to start: {holder.get('error')!r}")
        if time.monotonic() > deadline:
            raise TimeoutError("server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        holder["server"].should_exit = True  # type: ignore[attr-defined]
        thread.join(10)
        sock.close()


@contextlib.asynccontextmanager
async def static_app(app: FastAPI) -> AsyncIterator[FastAPI]:
    yield app
