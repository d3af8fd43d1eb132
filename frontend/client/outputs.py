"""What the client library hands back to its callers, and the errors it raises."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.metrics import RequestMetrics
from protocol.outcomes import ErrorKind


class RequestRejected(ValueError):
    """The engine refused or could not run the request; the others go on.

    `kind` says whose the problem is: INVALID_REQUEST (fix the input: `field` names the
    request field at fault, "prompt", "params.max_tokens"..., as does the message), BUSY
    (send it again later) or REQUEST_FAILED (the engine could not run this request)."""

    def __init__(self, message: str, field: str | None = None,
                 kind: ErrorKind = ErrorKind.INVALID_REQUEST) -> None:
        super().__init__(message)
        self.field = field
        self.kind = kind


class EngineDeadError(RuntimeError):
    """The pipeline is gone or broken: in-flight and later requests fail with this."""


class ConnectionLostError(EngineDeadError):
    """The connection to the pipeline dropped (no answer within the heartbeat timeout) with no
    word of its death: the requests in flight fail with this, and new ones until the client
    has reconnected, which it does by itself."""


class ClientClosedError(RuntimeError):
    """The client was closed while the request was still running."""


@dataclass(frozen=True, slots=True)
class RequestDelta:
    """What one request produced since its previous delta (text and token_ids are new only)."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    """Cumulative count of generated tokens so far."""
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """Per token: (token id, logprob) of the most likely tokens at its step, best first."""
    metrics: RequestMetrics | None = None
    """On the final delta: the request's timings and prefix-cache use."""
    token_bytes: list[bytes] | None = None
    """With logprobs: each token's bytes (`token_text` names it as OpenAI does)."""
    top_token_bytes: list[list[bytes]] | None = None
    """With top_logprobs: the bytes of each alternative in top_logprobs."""


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """A finished request: the whole generated text and tokens."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    metrics: RequestMetrics | None = None
    """Queue time, TTFT, TPOT, end-to-end time and cached prompt tokens, as the scheduler
    measured them (None only if the engine died before the request finished there)."""
    token_bytes: list[bytes] | None = None
    """With logprobs: each token's bytes (`token_text` names it as OpenAI does)."""
    top_token_bytes: list[list[bytes]] | None = None
    """With top_logprobs: the bytes of each alternative in top_logprobs."""


class OutputCollector:
    """Folds a request's deltas into its RequestOutput."""

    __slots__ = ("request_id", "_text", "_token_ids", "_logprobs", "_top", "_bytes",
                 "_top_bytes", "_last")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._text: list[str] = []
        self._token_ids: list[int] = []
        self._logprobs: list[float] | None = None
        self._top: list[list[tuple[int, float]]] | None = None
        self._bytes: list[bytes] | None = None
        self._top_bytes: list[list[bytes]] | None = None
        self._last: RequestDelta | None = None

    def add(self, delta: RequestDelta) -> None:
        self._text.append(delta.text)
        self._token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self._logprobs is None:
                self._logprobs = []
            self._logprobs.extend(delta.logprobs)
        if delta.top_logprobs is not None:
            self._top = (self._top or []) + delta.top_logprobs
        if delta.token_bytes is not None:
            self._bytes = (self._bytes or []) + delta.token_bytes
        if delta.top_token_bytes is not None:
            self._top_bytes = (self._top_bytes or []) + delta.top_token_bytes
        self._last = delta

    def output(self) -> RequestOutput:
        last = self._last
        return RequestOutput(
            request_id=self.request_id,
            text="".join(self._text),
            token_ids=self._token_ids,
            finish_reason=last.finish_reason if last else None,
            prompt_tokens=last.prompt_tokens if last else 0,
            completion_tokens=last.completion_tokens if last else 0,
            logprobs=self._logprobs,
            top_logprobs=self._top,
            metrics=last.metrics if last else None,
            token_bytes=self._bytes,
            top_token_bytes=self._top_bytes,
        )


def token_text(token: bytes) -> str:
    """A token's bytes as OpenAI names a token: its text, or, when the bytes are not whole
    UTF-8 characters, "bytes:" and their escapes (its `bytes` list says them exactly)."""
    try:
        return token.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in token)
