"""Messages between a client and the frontend (tokenizer in, detokenizer out)."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

from protocol.codec import message, struct
from protocol.metrics import RequestMetrics
from protocol.outcomes import FieldError, FinishReason, RequestError
from protocol.sampling_params import SamplingParams, check_token_ids


class RequestFieldError(FieldError):
    """A request field that no process could carry or store (`field` names it)."""


def as_token_ids(values: Any) -> list[Any]:
    """Token ids of any integer type (numpy's too) as ints. Anything else (a float, a bool) is
    kept as it is, for GenerateRequest to refuse by name rather than truncate."""
    out = []
    for t in values:
        if not isinstance(t, bool):
            try:
                t = operator.index(t)
            except TypeError:
                pass
        out.append(t)
    return out


@struct
@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


@message(0x01)
@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """Exactly one of prompt, prompt_token_ids and messages is set."""

    client_request_id: str
    """Chosen by the client, unique among its own requests; results carry it back."""
    prompt: str | None
    prompt_token_ids: list[int] | None
    messages: list[ChatMessage] | None
    params: SamplingParams
    stream: bool

    def __post_init__(self) -> None:
        # Checked where the request is made and again where it is decoded: a float or an id
        # past int32 must not be truncated on the way, nor overflow a worker's column.
        if self.prompt_token_ids is not None:
            check_token_ids("prompt_token_ids", self.prompt_token_ids, RequestFieldError)


@message(0x02)
@dataclass(frozen=True, slots=True)
class AbortRequest:
    client_request_id: str


@message(0x03)
@dataclass(frozen=True, slots=True)
class ClientHello:
    """First frame on each client socket: lets a ROUTER learn the route before results flow."""

    client_id: str


@message(0x04)
@dataclass(frozen=True, slots=True)
class ClientWelcome:
    results_address: str
    """Where the client connects to receive its results (the detokenizer)."""
    model: str
    max_model_len: int
    deltas_address: str = ""
    """Where the scheduler publishes every request's tokens, for detokenizers that attach by
    the pipeline's public address ("" when it is not offered)."""


@message(0x05)
@dataclass(frozen=True, slots=True)
class ResultDelta:
    """What a request produced since its last delta (or everything, when not streaming)."""

    client_request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    """None while the request runs (outcomes.py maps it to the string users see)."""
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[float] | None
    error: RequestError | None
    """Set when the request was rejected or failed; finish_reason is then ERROR."""
    top_token_ids: list[list[int]] | None = None
    """Per token: the most likely tokens at its step, best first (with top_logprobs)."""
    top_logprobs: list[list[float]] | None = None
    metrics: RequestMetrics | None = None
    """On the final delta of a request the scheduler ran: its timings and cache use."""


@message(0x07)
@dataclass(frozen=True, slots=True)
class ResultDeltaBatch:
    """Every delta one engine step produced for one client, in one frame.

    With hundreds of requests streaming to one client, a frame per request per step costs
    the client more than the step itself.
    """

    deltas: list[ResultDelta]


@message(0x06)
@dataclass(frozen=True, slots=True)
class EngineDead:
    """The pipeline lost a process: every in-flight and later request fails with this reason.

    Engine death is this message of its own (and ErrorKind.ENGINE_DEAD on a request's error),
    never a text to recognise."""

    reason: str
