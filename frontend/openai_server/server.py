"""OpenAI-compatible HTTP server: FastAPI routes over one AsyncClient of a running pipeline.

`python -m frontend.openai_server.server --address PIPELINE_ADDRESS --port 8000` serves
/v1/completions, /v1/chat/completions (streaming over SSE or not), /v1/models and /health
on 127.0.0.1.
A client that goes away aborts its request, so the engine stops spending KV blocks on it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from frontend.client.outputs import ClientClosedError, EngineDeadError, RequestRejected
from frontend.openai_server.schema import (
    ApiError,
    ChatCompletionRequest,
    ChatFormat,
    CompletionFormat,
    CompletionRequest,
    dumps,
    error_body,
    http_param,
    params_error,
    validation_error,
)
from protocol import SamplingParams, SamplingParamsError
from protocol.client_messages import RequestFieldError

if TYPE_CHECKING:
    from frontend.client.async_client import AsyncClient

T = TypeVar("T")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

MAX_BYTES_PER_TOKEN = 64
"""A generous bound on what one prompt token costs in a JSON body: an id is at most 11 bytes,
and text that json.dumps escapes (\\uXXXX, 6 bytes a character) rarely passes 12 a token."""
JSON_ROOM_BYTES = 1 << 20
"""Room for everything else a body holds: parameters, stop strings, chat roles."""


def default_max_request_bytes(max_model_len: int) -> int:
    """The largest body a request that fits the context can need, with room to spare."""
    return MAX_BYTES_PER_TOKEN * max_model_len + JSON_ROOM_BYTES


def _api_error(exc: BaseException) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, EngineDeadError | ClientClosedError):
        return ApiError(503, f"engine is dead: {exc}", type="engine_dead", code="engine_dead")
    if isinstance(exc, SamplingParamsError):
        return params_error(exc)
    if isinstance(exc, RequestFieldError | RequestRejected):
        return ApiError(400, str(exc), param=http_param(exc.field))
    return ApiError(500, f"internal error: {exc}", type="server_error")


def _error_response(exc: BaseException) -> JSONResponse:
    err = _api_error(exc)
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


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


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready; its request is aborted."""


async def _until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its request) if the HTTP client goes away."""
    work_task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work_task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work_task.done():
            work_task.cancel()
            with contextlib.suppress(BaseException):
                await work_task
    if work_task.cancelled():
        raise ClientGone()
    return work_task.result()


async def _wait_disconnect(request: Request) -> None:
    # The body is already read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(client: AsyncClient, model_name: str, api_key: str | None = None,
               max_model_len: int | None = None, max_request_bytes: int | None = None
               ) -> FastAPI:
    """The app serving `client`'s pipeline as `model_name`; `api_key` turns on Bearer auth.

    `client` is started (its `welcome` holds the pipeline's max_model_len), or
    `max_model_len` is given. Bodies over `max_request_bytes` (default: derived from
    max_model_len) are refused with 413 before they are parsed.
    """
    if max_model_len is None:
        max_model_len = client.welcome.max_model_len
    if max_request_bytes is None:
        max_request_bytes = default_max_request_bytes(max_model_len)
    app = FastAPI(title="nanopipe", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)

    async def _error(_req: Request, exc: Exception) -> JSONResponse:
        return _error_response(exc)

    for exc_type in (ApiError, EngineDeadError, ClientClosedError, RequestRejected,
                     SamplingParamsError, Exception):
        app.add_exception_handler(exc_type, _error)

    @app.exception_handler(ClientGone)
    async def _gone(_req: Request, _exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

    async def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), api_key.encode()
        ):
            raise ApiError(401, "missing or invalid API key (send 'Authorization: Bearer KEY')",
                           code="invalid_api_key")

    def check_model(requested: str | None) -> None:
        if requested is not None and requested != model_name:
            raise ApiError(404, f"model {requested!r} does not exist; this server serves "
                           f"{model_name!r}", param="model", type="not_found_error",
                           code="model_not_found")

    @app.get("/health")
    async def health() -> Response:
        if _is_dead(client):
            return JSONResponse(error_body("engine is dead", "engine_dead", code="engine_dead"),
                                status_code=503)
        return Response(status_code=200)

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "nanopipe",
                "max_model_len": max_model_len}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        params = body.choice_params(body.sampling_params())
        fmt = CompletionFormat(model_name, body.include_usage)
        return await _respond(request, client, body.prompt_kwargs(), params, body.stream, fmt)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        # Without a max_tokens, a chat answer may fill the context (OpenAI's default).
        params = body.choice_params(body.sampling_params())
        fmt = ChatFormat(model_name, body.include_usage)
        kwargs = {"messages": body.wire_messages()}
        return await _respond(request, client, kwargs, params, body.stream, fmt)

    return app


def _is_dead(client: AsyncClient) -> bool:
    """The client records why the pipeline died (EngineDead, a dropped connection)."""
    return client.dead


async def _respond(request: Request, client: AsyncClient, kwargs: dict[str, Any],
                   params: list[SamplingParams], stream: bool,
                   fmt: CompletionFormat | ChatFormat) -> Response:
    if _is_dead(client):
        raise EngineDeadError("the pipeline is not running")
    return await _attempt(request, client, kwargs, params, stream, fmt)


async def _attempt(request: Request, client: AsyncClient, kwargs: dict[str, Any],
                   params: list[SamplingParams], stream: bool,
                   fmt: CompletionFormat | ChatFormat) -> Response:
    """One engine request per choice (`n`); the shared prompt is a prefix-cache hit."""
    if not stream:
        outs = await _until_disconnected(request, _all_or_none(
            [client.generate(**kwargs, params=p) for p in params]))
        return JSONResponse(fmt.response(outs))
    streams = [client.stream(**kwargs, params=p) for p in params]
    try:
        # Wait for each choice's first delta before answering 200, so a rejection is a 400.
        firsts = await _until_disconnected(request, _all_or_none(
            [anext(s, None) for s in streams]))
    except BaseException:
        await _close_all(*streams)
        raise
    events = _sse(fmt, len(streams), _merged(firsts, streams))
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS,
                             background=BackgroundTask(_close_all, events, *streams))


async def _all_or_none(works: list[Awaitable[T]]) -> list[T]:
    """Every result, or the first failure with the rest cancelled (which aborts them)."""
    tasks = [asyncio.ensure_future(w) for w in works]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _merged(firsts: list[Any], streams: list[AsyncIterator[Any]]
                  ) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, delta) from every stream in arrival order; a failure ends it."""
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()

    async def pump(index: int, delta: Any, stream: AsyncIterator[Any]) -> None:
        try:
            while delta is not None:
                await queue.put((index, delta, None))
                delta = await anext(stream, None)
        except Exception as exc:
            await queue.put((index, None, exc))
            return
        await queue.put((index, None, None))

    tasks = [asyncio.ensure_future(pump(i, first, stream))
             for i, (first, stream) in enumerate(zip(firsts, streams, strict=True))]
    try:
        running = len(tasks)
        while running:
            index, delta, exc = await queue.get()
            if exc is not None:
                raise exc
            if delta is None:
                running -= 1
            else:
                yield index, delta
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _sse(fmt: CompletionFormat | ChatFormat, num_choices: int,
               deltas: AsyncIterator[tuple[int, Any]]) -> AsyncIterator[bytes]:
    try:
        for chunk in fmt.start_chunks(num_choices):
            yield _event(chunk)
        async for index, delta in deltas:
            for chunk in fmt.delta_chunks(delta, index):
                yield _event(chunk)
        for chunk in fmt.end_chunks():
            yield _event(chunk)
    except Exception as exc:
        # Headers are gone already: the error travels as an event, as OpenAI's server does.
        yield _event(_api_error(exc).body())
    finally:
        await _close(deltas)
    yield b"data: [DONE]\n\n"


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


async def _close(it: Any) -> None:
    aclose: Callable[[], Awaitable[None]] | None = getattr(it, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()


async def _close_all(*its: Any) -> None:
    """Runs after the response, also after a disconnect cancelled it mid-stream."""
    for it in its:
        await _close(it)


def serve(address: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          model_name: str | None = None, log_level: str = "info",
          max_request_bytes: int | None = None, *,
          sock: socket.socket | None = None,
          engine_alive: Callable[[], bool] | None = None) -> None:
    """Connect to the pipeline at `address` and serve it over HTTP until interrupted.

    `sock`, when given, is an already bound listening socket (host and port are then
    ignored). `engine_alive`, when given, is checked every half second: the server stops
    once it returns False, so the HTTP front never outlives its engine.
    """
    import uvicorn

    from frontend.client.async_client import AsyncClient

    async def stop_with_engine(server: uvicorn.Server) -> None:
        while not server.should_exit:
            if not engine_alive():
                server.should_exit = True
            await asyncio.sleep(0.5)

    async def run() -> None:
        async with AsyncClient(address) as client:
            name = model_name or client.welcome.model
            app = create_app(client, name, api_key, max_request_bytes=max_request_bytes)
            config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                    lifespan="off", timeout_graceful_shutdown=5)
            server = uvicorn.Server(config)
            watch = asyncio.ensure_future(stop_with_engine(server)) if engine_alive else None
            try:
                await server.serve(sockets=[sock] if sock is not None else None)
            finally:
                if watch is not None:
                    watch.cancel()

    try:
        import uvloop
    except ImportError:
        asyncio.run(run())
    else:
        uvloop.run(run())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="OpenAI-compatible HTTP server for nanopipe")
    parser.add_argument("--address", required=True,
                        help="the pipeline's client address (printed by the launcher)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    parser.add_argument("--served-model-name", default=None,
                        help="the model id clients use (default: the pipeline's model)")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--max-request-bytes", type=int, default=None,
                        help="refuse larger request bodies with 413 (default: "
                        f"{MAX_BYTES_PER_TOKEN} x max_model_len + {JSON_ROOM_BYTES})")
    args = parser.parse_args(argv)
    serve(args.address, args.host, args.port, args.api_key, args.served_model_name,
          args.log_level, args.max_request_bytes)


if __name__ == "__main__":
    main()
