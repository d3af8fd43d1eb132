"""Checks a GenerateRequest and turns it into prompt token ids, or says what is wrong.

Every error names the offending field (its `field`, and its message), so a client can fix
its request; nothing here raises anything but `InvalidRequest` for bad input. Whether the
prompt and max_tokens fit max_model_len is the scheduler's to judge (it admits requests).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from protocol import FieldError, GenerateRequest
from protocol.codec import kind_of, peek_head
from protocol.structured_outputs import StructuredOutputsError, check_compiles
from protocol.template_kwargs import from_text as template_kwargs_from_text

MAX_REQUEST_ID_CHARS = 256
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
_ID_POSITION = 1 + [f.name for f in dataclasses.fields(GenerateRequest)].index(
    "client_request_id")
"""Where a GenerateRequest frame holds its id (after the kind), read from the message type."""


class InvalidRequest(FieldError):
    """Bad client input (`field` names it); the message is sent back to the client as is."""


class RequestValidator:
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    def prompt_token_ids(self, req: GenerateRequest) -> list[int]:
        """Validate the request and return its prompt token ids."""
        _check_request_id(req.client_request_id)
        given = [name for name, value in (("prompt", req.prompt),
                                          ("prompt_token_ids", req.prompt_token_ids),
                                          ("messages", req.messages)) if value is not None]
        if len(given) != 1:
            got = ", ".join(given) if given else "none"
            raise InvalidRequest(
                given[0] if given else "prompt",
                f"exactly one of prompt, prompt_token_ids and messages must be set (got {got})"
            )
        if req.prompt is not None:
            if not req.prompt:
                raise InvalidRequest("prompt", "prompt must not be empty")
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=True)
            if not ids:
                raise InvalidRequest("prompt", "prompt must not be empty (it has no tokens)")
        elif req.prompt_token_ids is not None:
            ids = req.prompt_token_ids
            if not ids:
                raise InvalidRequest("prompt_token_ids", "prompt_token_ids must not be empty")
            self._check_ids("prompt_token_ids", ids)
        else:
            ids = self._chat_ids(req.messages or [], req.chat_template_kwargs)
        self._check_ids("params.stop_token_ids", req.params.stop_token_ids)
        if req.params.structured_outputs is not None:  # before the scheduler sees it
            try:
                check_compiles(req.params.structured_outputs, "params.structured_outputs")
            except StructuredOutputsError as exc:
                raise InvalidRequest(exc.field, str(exc)) from None
        if req.params.n != 1:
            raise InvalidRequest("params.n", f"params.n is {req.params.n}: an engine request is "
                                 "one completion; send one request per choice (LLM.generate "
                                 "and the HTTP API do that for n)")
        return list(ids)

    def _check_ids(self, field: str, ids: list[int]) -> None:
        for i, t in enumerate(ids):
            if not 0 <= t < self.vocab_size:
                raise InvalidRequest(
                    field, f"{field}[{i}] = {t} is outside the vocabulary [0, {self.vocab_size})"
                )

    def _chat_ids(self, messages: list, template_kwargs: str = "") -> list[int]:
        """template_kwargs: the chat template's extra variables, as the request's JSON text
        (checked when the request was decoded: protocol.template_kwargs)."""
        if not messages:
            raise InvalidRequest("messages", "messages must not be empty")
        for i, m in enumerate(messages):
            if m.role not in CHAT_ROLES:
                roles = ", ".join(sorted(CHAT_ROLES))
                raise InvalidRequest("messages", f"messages[{i}].role must be one of {roles}, "
                                                 f"got {m.role!r}")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidRequest("messages",
                                 "messages: this model has no chat template; send a prompt")
        conversation = [{"role": m.role, "content": m.content} for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=False,
                **template_kwargs_from_text(template_kwargs)
            )
        except Exception as exc:  # jinja templates raise their own errors for bad turns
            raise InvalidRequest("messages",
                                 f"messages: the chat template refused them: {exc}") from exc
        # The template writes the special tokens (BOS included) itself.
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise InvalidRequest("messages", "messages must not be empty (they have no tokens)")
        return ids


def _check_request_id(request_id: str) -> None:
    if not request_id:
        raise InvalidRequest("client_request_id", "client_request_id must not be empty")
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest("client_request_id", f"client_request_id must be at most "
                                                   f"{MAX_REQUEST_ID_CHARS} characters")


def peek_request_id(frame: bytes | memoryview) -> str | None:
    """None unless the frame's head is a GenerateRequest's; then its client_request_id ("" when
    that is no string). Only the frame's first bytes are read, so this is cheap at any size."""
    head = peek_head(frame, _ID_POSITION + 1)
    if head is None or head[0] != kind_of(GenerateRequest):
        return None
    request_id = head[_ID_POSITION]
    return request_id if type(request_id) is str else ""


def salvage_request_id(frame: bytes | memoryview) -> str | None:
    """The client_request_id of a GenerateRequest frame the decoder refused, if readable.

    Lets a request that cannot be decoded (out-of-range sampling parameters, a frame over
    the size limit, a body cut short) be rejected by its id instead of leaving its client
    waiting.
    """
    request_id = peek_request_id(frame)
    return request_id if request_id and len(request_id) <= MAX_REQUEST_ID_CHARS else None

