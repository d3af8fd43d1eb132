"""Every failure a client can cause or meet, as OpenAI's `{"error": {...}}` body and status.

One place decides the HTTP status of each error kind (a bad field 400, a busy engine 429, a
request the engine could not run 500, a dead engine 503),
so the JSON answer, the SSE error event and the request models all agree.
"""

from __future__ import annotations

import re
from typing import Any

from frontend.client.outputs import (
    ClientClosedError,
    ConnectionLostError,
    EngineDeadError,
    RequestRejected,
)
from protocol import SamplingParamsError
from protocol.client_messages import RequestFieldError
from protocol.outcomes import ErrorKind


class ApiError(Exception):
    """An error that reaches the HTTP client as OpenAI's `{"error": {...}}` body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


# pydantic puts union-member tags ("str", "list[int]", "TextPart") into error locations.
_LOC_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|[A-Z]\w*|function-.*)$")


def params_error(exc: SamplingParamsError) -> ApiError:
    return invalid(str(exc), exc.field)


_BODY_NAMES = {"prompt_token_ids": "prompt", "client_request_id": None}
"""Engine request fields that the OpenAI body names otherwise (or not at all)."""


_ENGINE_NAMES = re.compile(r"\bparams\.(?=\w)|\bprompt_token_ids\b")


def in_body_words(message: str) -> str:
    """An engine message with its fields named as the body names them ("params.max_tokens" is
    `max_tokens`, "prompt_token_ids" is `prompt`)."""
    return _ENGINE_NAMES.sub(lambda m: "prompt" if m.group(0) == "prompt_token_ids" else "",
                             message)


def http_param(field: str | None, constrained_by: str | None = None) -> str | None:
    """The body's name of a field the engine names as a GenerateRequest field
    ("params.max_tokens" is `max_tokens`, "prompt_token_ids" is `prompt`). The engine calls
    every output constraint "params.structured_outputs"; `constrained_by` is the body field
    that set it (response_format, tool_choice...), which is what the client can fix."""
    if field is None:
        return None
    name = field.removeprefix("params.")
    if constrained_by is not None and name.split(".")[0] == "structured_outputs":
        return constrained_by
    return _BODY_NAMES.get(name, name)


def validation_error(errors: list[dict[str, Any]]) -> ApiError:
    """The first field's pydantic error, with its location written as `messages[0].content`.

    A union (`str | list[TextPart]`) reports one error per member; the one that got deepest
    into the value says most about what is wrong, and among those one whose type matched
    (a value error rather than "should be an integer").
    """
    if not errors:
        return invalid("invalid request body")

    def loc_of(e: dict[str, Any]) -> list[Any]:
        return [p for p in e.get("loc", ()) if not (isinstance(p, str) and _LOC_TAG.match(p))]

    field = loc_of(errors[0])[:2]
    err = max((e for e in errors if loc_of(e)[:2] == field),
              key=lambda e: (len(loc_of(e)), not str(e.get("type", "")).endswith("_type")))
    loc = loc_of(err)
    if loc and loc[0] == "body":
        loc = loc[1:]
    if err.get("type") == "json_invalid":
        return invalid(f"request body is not valid JSON: {err.get('msg', '')}")
    if not loc:  # FastAPI parses only a JSON content type, and the body must be an object
        return invalid("the request body must be a JSON object, sent with "
                       "'Content-Type: application/json'")
    param = ""
    for part in loc:
        param += f"[{part}]" if isinstance(part, int) else (f".{part}" if param else str(part))
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")  # our own checks
    return invalid(f"{param}: {msg}" if param else msg, param or None)


def api_error(exc: BaseException, constrained_by: str | None = None) -> ApiError:
    """What the client is told about `exc`: its own mistakes 400, busy 429, a dead engine 503,
    a request the engine could not run or a bug 500. `constrained_by`: the body field that
    constrained the request's output (see http_param)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ConnectionLostError):
        return ApiError(503, f"engine unreachable: {exc}; retry the request",
                        type="server_error", code="engine_unreachable")
    if isinstance(exc, EngineDeadError | ClientClosedError):
        text = str(exc)  # the engine's own words begin "engine dead: " already
        text = text if text.startswith("engine dead") else f"engine dead: {text}"
        return ApiError(503, text, type="engine_dead", code="engine_dead")
    if isinstance(exc, SamplingParamsError):
        return params_error(exc)
    if isinstance(exc, RequestRejected) and exc.kind is ErrorKind.BUSY:
        return ApiError(429, str(exc), type="rate_limit_error", code="busy")
    if isinstance(exc, RequestRejected) and exc.kind is ErrorKind.REQUEST_FAILED:
        return ApiError(500, str(exc), type="server_error")
    if isinstance(exc, RequestFieldError | RequestRejected):
        return ApiError(400, in_body_words(str(exc)),
                        param=http_param(exc.field, constrained_by))
    return ApiError(500, f"internal error: {exc}", type="server_error")
