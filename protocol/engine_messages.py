"""Messages from the frontend to the scheduler, and from the tokenizer to the detokenizer."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.codec import message
from protocol.sampling_params import SamplingParams


@message(0x10)
@dataclass(frozen=True, slots=True)
class AddRequest:
    request_id: int
    """Assigned by the tokenizer; also the sequence id in the scheduler and the workers."""
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int]


@message(0x11)
@dataclass(frozen=True, slots=True)
class AbortRequests:
    request_ids: list[int]
    reason: str
    """"abort" (client gave up) or "stop" (the detokenizer matched a stop string)."""


@message(0x12)
@dataclass(frozen=True, slots=True)
class DetokRequestInfo:
    """Everything the detokenizer needs to decode a request and route it to its client."""

    request_id: int
    client_id: str
    client_request_id: str
    prompt_tail_token_ids: list[int]
    """The last prompt tokens: decoding starts after them so the first word is spaced right."""
    num_prompt_tokens: int
    stop: list[str]
    skip_special_tokens: bool
    stream: bool
    logprobs: bool
    top_logprobs: int = 0
    """How many alternatives of each token to pass on (the step may carry more)."""
