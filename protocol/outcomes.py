"""How a request ends, as typed values: finish reasons and error kinds travel as small
enums, and this module holds the one table that turns them into the strings users see.

No process reads another's message text to learn why a request ended: the reason, the kind of
error and the request field at fault are fields of their own.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from protocol.codec import struct


class FinishReason(enum.IntEnum):
    """Why a request stopped generating; on the wire, one small integer."""

    STOP = 0
    """EOS, a stop token id or a stop string."""
    LENGTH = 1
    """max_tokens, or the end of the context (max_model_len)."""
    ABORT = 2
    """The client gave up (or went away)."""
    ERROR = 3
    """The request failed; its RequestError says why."""

    def __str__(self) -> str:
        return FINISH_REASON_STRINGS[self]

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


FINISH_REASON_STRINGS: dict[FinishReason, str] = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
    FinishReason.ERROR: "error",
}
"""What users see (OpenAI's names, and vLLM's "abort" and "error")."""


def finish_reason_string(reason: FinishReason | None) -> str | None:
    return None if reason is None else FINISH_REASON_STRINGS[reason]


class ErrorKind(enum.IntEnum):
    """What a request's error means for the client."""

    INVALID_REQUEST = 0
    """The request is wrong (RequestError.field names what); fix it and send it again."""
    REQUEST_FAILED = 1
    """The engine could not run this request (a worker refused its contents, the tokenizer
    failed on it); every other request goes on."""
    ENGINE_DEAD = 2
    """The pipeline lost a process: this and every later request fails."""
    BUSY = 3
    """The engine will not take this request now (this client has too much waiting); the
    same request may succeed when sent again later."""


@struct
@dataclass(frozen=True, slots=True)
class RequestError:
    """Why one request failed."""

    kind: ErrorKind
    message: str
    """For people: says what is wrong and, for a bad request, what to change."""
    field: str | None = None
    """The request field at fault, as the GenerateRequest names it ("prompt",
    "prompt_token_ids", "messages", "params.max_tokens"...); None when no one field is."""


def invalid(message: str, field: str | None = None) -> RequestError:
    return RequestError(ErrorKind.INVALID_REQUEST, message, field)


class FieldError(ValueError):
    """Bad input in one field: `field` names it, the message says what is wrong with it."""

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message)
        self.field = field

    def to_wire(self) -> RequestError:
        return invalid(str(self), self.field)
