"""The client's side of the wire format: a request as it is sent, a result as the caller sees it."""

from __future__ import annotations

from typing import Any

from frontend.client.chat_input import as_chat_messages
from frontend.client.outputs import EngineDeadError, RequestDelta, RequestRejected
from protocol import (
    MAX_FRAME_BYTES,
    ErrorKind,
    GenerateRequest,
    ResultDelta,
    SamplingParams,
    encode,
)
from protocol.client_messages import RequestFieldError, as_token_ids
from protocol.outcomes import finish_reason_string
from protocol.sampling_params import SamplingParamsLike, as_sampling_params
from protocol.template_kwargs import FIELD, TemplateKwargsError, to_text


def make_request(request_id: str, prompt: str | None, prompt_token_ids: Any, messages: Any,
                 params: SamplingParamsLike | None, stream: bool,
                 client_key: str | None = None, chat_template_kwargs: Any = None) -> bytes:
    """The encoded request; RequestRejected at once if no pipeline would read a frame so big.
    `params` may be a dict of SamplingParams' fields, as LLM.generate takes them;
    `client_key` names whose share within this connection the request counts against;
    `chat_template_kwargs` (with messages) are checked here (protocol.template_kwargs)."""
    params = SamplingParams() if params is None else as_sampling_params(params, "params")
    if prompt is not None and not isinstance(prompt, str):
        hint = " (token ids go in prompt_token_ids=)" if isinstance(prompt, list | tuple) else ""
        raise TypeError(f"prompt must be a string, got {type(prompt).__name__}{hint}")
    if prompt_token_ids is not None:
        prompt_token_ids = as_token_ids(prompt_token_ids)
    if messages is not None:
        messages = as_chat_messages(messages)
    if client_key is not None and not isinstance(client_key, str):
        raise TypeError(f"client_key must be a string, got {type(client_key).__name__}")
    frame = encode(GenerateRequest(
        client_request_id=request_id, prompt=prompt, prompt_token_ids=prompt_token_ids,
        messages=messages, params=params, stream=stream, client_key=client_key or "",
        chat_template_kwargs=_template_text(chat_template_kwargs)))
    if len(frame) > MAX_FRAME_BYTES:
        sizes = {"prompt": len(prompt or ""), "prompt_token_ids": len(prompt_token_ids or ()),
                 "messages": sum(len(m.content) for m in messages or ())}
        field = max(sizes, key=sizes.__getitem__)
        raise RequestRejected(f"{field}: the request encodes to {len(frame)} bytes, over the "
                              f"{MAX_FRAME_BYTES}-byte limit of one message; shorten the {field}",
                              field)
    return frame


def outcome(msg: ResultDelta) -> RequestDelta | Exception:
    """What one result means to its caller: the only place the client reads wire outcomes."""
    if msg.error is not None:
        if msg.error.kind is ErrorKind.ENGINE_DEAD:
            return EngineDeadError(msg.error.message)
        return RequestRejected(msg.error.message, msg.error.field, msg.error.kind)
    top = None
    if msg.top_token_ids is not None and msg.top_logprobs is not None:
        top = [list(zip(ids, lps, strict=True))
               for ids, lps in zip(msg.top_token_ids, msg.top_logprobs, strict=True)]
    return RequestDelta(request_id=msg.client_request_id, text=msg.text,
                        token_ids=msg.token_ids,
                        finish_reason=finish_reason_string(msg.finish_reason),
                        prompt_tokens=msg.prompt_tokens,
                        completion_tokens=msg.completion_tokens, logprobs=msg.logprobs,
                        top_logprobs=top, metrics=msg.metrics, token_bytes=msg.token_bytes,
                        top_token_bytes=msg.top_token_bytes)


def _template_text(value: Any) -> str:
    try:
        return to_text(value)
    except TemplateKwargsError as exc:
        raise RequestFieldError(FIELD, str(exc)) from None
