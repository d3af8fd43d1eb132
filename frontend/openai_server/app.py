"""The FastAPI app: routes, Bearer auth, the served model's name, and error handlers that
turn every failure into OpenAI's error body."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from frontend.client.outputs import ClientClosedError, EngineDeadError, RequestRejected
from frontend.openai_server.body_limit import BodyLimit, default_max_request_bytes
from frontend.openai_server.client_key import client_key
from frontend.openai_server.errors import ApiError, api_error, error_body, validation_error
from frontend.openai_server.health import health_of
from frontend.openai_server.responses import ChatFormat, CompletionFormat
from frontend.openai_server.schema import ChatCompletionRequest, CompletionRequest
from frontend.openai_server.streaming import Choice, ClientGone, answer
from protocol import SamplingParamsError

if TYPE_CHECKING:
    from frontend.client.async_client import AsyncClient
    from frontend.metrics import EngineMetrics


def _error_response(exc: BaseException) -> JSONResponse:
    err = api_error(exc)
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def create_app(client: AsyncClient, model_name: str, api_key: str | None = None,
               max_model_len: int | None = None, max_request_bytes: int | None = None,
               metrics: EngineMetrics | None = None,
               degraded: Callable[[], str | None] | None = None,
               drained: asyncio.Event | None = None,
               stopping: Callable[[], bool] | None = None,
               reasoning_parser: str | None = None) -> FastAPI:
    """The app serving `client`'s pipeline as `model_name`; `api_key` turns on Bearer auth.
    With `metrics`, `/metrics` serves them in the Prometheus text format (without auth, like
    /health: scrapers rarely hold API keys).

    `client` is started (its `welcome` holds the pipeline's max_model_len), or
    `max_model_len` is given. Bodies over `max_request_bytes` (default: derived from
    max_model_len) are refused with 413 before they are parsed. `degraded`, when given,
    says why some data-parallel replicas are down (None while all serve): /health reports it.
    `drained` is set when a stopping server's grace is over (draining.Drain): requests still
    running are then answered with a 503. `stopping` says the server was told to stop:
    /health is then a 503 `shutting_down`. `reasoning_parser` (protocol.reasoning) splits
    chat answers' `reasoning_content` off their content and leaves the reasoning free of a
    request's constraint.
    """
    drained = drained or asyncio.Event()
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

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        state = health_of(client, degraded() if degraded is not None else None,
                          stopping=stopping is not None and stopping())
        return JSONResponse(state.body(), status_code=state.http_status)

    if metrics is not None:
        from prometheus_client import CONTENT_TYPE_LATEST

        @app.api_route("/metrics", methods=["GET", "HEAD"])
        async def prometheus() -> Response:
            return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    card = {"id": model_name, "object": "model", "created": 0, "owned_by": "nanopipe",
            "max_model_len": max_model_len}

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(authorize)])
    async def model(model_id: str) -> dict[str, Any]:
        check_model(model_id)
        return card

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        params = body.choice_params(body.sampling_params())
        fmt = CompletionFormat(model_name, body.include_usage, len(params))
        key = client_key(request, body.user)
        choices = [({**prompt, "client_key": key}, p) for prompt in body.prompt_kwargs()
                   for p in params]
        return await _respond(request, client, choices, body.stream, fmt, drained,
                              body.constraint_field())

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        # Without a max_tokens, a chat answer may fill the context (OpenAI's default).
        params = body.choice_params(body.sampling_params(reasoning_parser))
        fmt = ChatFormat(model_name, body.include_usage, len(params), tools=body.tool_plan(),
                         reasoning=reasoning_parser)
        messages = {"messages": body.wire_messages(), "client_key": client_key(request, body.user),
                    "chat_template_kwargs": body.template_kwargs()}
        choices = [(messages, p) for p in params]
        return await _respond(request, client, choices, body.stream, fmt, drained,
                              body.constraint_field())

    return app


def _is_dead(client: AsyncClient) -> bool:
    """The client records why the pipeline died (EngineDead, a dropped connection)."""
    return client.dead


async def _respond(request: Request, client: AsyncClient, choices: list[Choice], stream: bool,
                   fmt: CompletionFormat | ChatFormat, drained: asyncio.Event,
                   constrained_by: str | None) -> Response:
    if _is_dead(client):
        raise EngineDeadError(client.dead_reason or "the pipeline is not running")
    return await answer(request, client, choices, stream, fmt, drained, constrained_by)
