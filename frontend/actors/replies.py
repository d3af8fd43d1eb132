"""The terminal results an actor sends a client itself, without the engine: an error or an
abort answered on the spot. Shared by the tokenizer and the detokenizer so both speak the
same shape of refusal."""

from __future__ import annotations

from protocol import ErrorKind, FinishReason, ProtocolError, RequestError, ResultDelta
from protocol.outcomes import invalid


def engine_dead_error(reason: str) -> RequestError:
    return RequestError(ErrorKind.ENGINE_DEAD, f"engine dead: {reason}")


def error_delta(client_request_id: str, error: RequestError) -> ResultDelta:
    return ResultDelta(client_request_id=client_request_id, text="", token_ids=[],
                       finish_reason=FinishReason.ERROR, prompt_tokens=0, completion_tokens=0,
                       logprobs=None, error=error)


def abort_delta(client_request_id: str) -> ResultDelta:
    return ResultDelta(client_request_id=client_request_id, text="", token_ids=[],
                       finish_reason=FinishReason.ABORT, prompt_tokens=0, completion_tokens=0,
                       logprobs=None, error=None)


def malformed(exc: ProtocolError | str) -> RequestError:
    """A frame no decoder accepts; the field, when one field's own check refused it."""
    return invalid(f"malformed message: {exc}", getattr(exc, "field", None))
