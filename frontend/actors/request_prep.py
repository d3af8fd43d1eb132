"""Request preparation: from a client's request frame to the messages the pipeline needs.

Runs off the tokenizer's I/O loop (on a pool thread) so the loop never does work that grows
with a prompt: decode, refuse by size before tokenizing, validate, tokenize. Then the two
messages a prepared request becomes: the detokenizer's route and the scheduler's AddRequest.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from frontend.actors.incremental_detok import PROMPT_TAIL_TOKENS
from frontend.actors.prompt_limits import PromptLimits
from frontend.actors.replies import malformed
from frontend.actors.request_validation import InvalidRequest, RequestValidator
from frontend.actors.tokenize_pool import TokenizeJob
from protocol import (
    AddRequest,
    Decoder,
    DetokRequestInfo,
    ErrorKind,
    GenerateRequest,
    ProtocolError,
    RequestError,
)

log = logging.getLogger("nanopipe.tokenizer")


@dataclass(frozen=True)
class Prepared:
    """A request checked and tokenized by a pool thread, ready to forward."""

    request: GenerateRequest
    token_ids: list[int]


def prepare(decoder: Decoder, limits: PromptLimits, validator: RequestValidator,
            job: TokenizeJob) -> None:
    """On a pool thread: decode, refuse by size, validate and tokenize one request.

    The outcome goes to `job.result`: a Prepared, or the RequestError for the client."""
    try:
        req = decoder.decode(job.frame)
    except ProtocolError as exc:
        job.result = malformed(exc)
        return
    try:
        limits.check(req)  # before tokenizing: a prompt too big to fit costs nothing
        job.result = Prepared(req, validator.prompt_token_ids(req))
    except InvalidRequest as exc:
        job.result = exc.to_wire()
    except Exception as exc:  # a tokenizer failure is this request's problem only
        log.exception("tokenizer: could not tokenize request")
        job.result = RequestError(ErrorKind.REQUEST_FAILED,
                                  f"the prompt could not be tokenized: {exc}")


def detok_request_info(request_id: int, client_id: str, req: GenerateRequest,
                       ids: list[int]) -> DetokRequestInfo:
    """The detokenizer's route for a request: who gets its results and how to render them."""
    params = req.params
    return DetokRequestInfo(
        request_id=request_id, client_id=client_id, client_request_id=req.client_request_id,
        prompt_tail_token_ids=ids[-PROMPT_TAIL_TOKENS:], num_prompt_tokens=len(ids),
        stop=list(params.stop), skip_special_tokens=params.skip_special_tokens,
        stream=req.stream, logprobs=params.logprobs, top_logprobs=params.top_logprobs,
        include_stop=params.include_stop_str_in_output)


def add_request(request_id: int, req: GenerateRequest, ids: list[int],
                eos_ids: list[int], arrival_time: float, connection: int = 0) -> AddRequest:
    """The scheduler's view of a request. It judges the params' lengths itself (and resolves
    max_tokens=None), so they go as the client sent them; `arrival_time` (wall clock) is
    when its frame reached the tokenizer. Its client key is the number of the connection it
    came on, with the name the request gives within that connection, if any ("3/alice"):
    a connection can only divide its own share, never claim another's."""
    key = str(connection) if not req.client_key else f"{connection}/{req.client_key}"
    return AddRequest(request_id=request_id, prompt_token_ids=ids, params=req.params,
                      eos_token_ids=eos_ids, client_request_id=req.client_request_id,
                      arrival_time=arrival_time, client_key=key)
