"""Checks a GenerateRequest and turns it into prompt token ids, or says what is wrong.

Every message names the offending field, so a client can fix its request; nothing here
raises anything but `InvalidRequest` for bad input.
"""

from __future__ import annotations

from typing import Any

from protocol import GenerateRequest
from protocol.codec import kind_of, peek_head

MAX_REQUEST_ID_CHARS = 256
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


class InvalidRequest(ValueError):
    """Bad client input; the message is sent back to the client as is."""


class RequestValidator:
    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def prompt_token_ids(self, req: GenerateRequest) -> list[int]:
        """Validate the request and return its prompt token ids."""
        _check_request_id(req.client_request_id)
        given = [name for name, value in (("prompt", req.prompt),
                                          ("prompt_token_ids", req.prompt_token_ids),
                                          ("messages", req.messages)) if value is not None]
        if len(given) != 1:
            got = ", ".join(given) if given else "none"
            raise InvalidRequest(
                f"exactly one of prompt, prompt_token_ids and messages must be set (got {got})"
            )
        if req.prompt is not None:
            if not req.prompt:
                raise InvalidRequest("prompt must not be empty")
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=True)
            if not ids:
                raise InvalidRequest("prompt must not be empty (it has no tokens)")
        elif req.prompt_token_ids is not None:
            ids = req.prompt_token_ids
            if not ids:
                raise InvalidRequest("prompt_token_ids must not be empty")
            self._check_ids("prompt_token_ids", ids)
        else:
            ids = self._chat_ids(req.messages or [])
        self._check_ids("params.stop_token_ids", req.params.stop_token_ids)
        self._check_length(len(ids), req.params.max_tokens)
        return list(ids)

    def max_tokens(self, num_prompt: int, requested: int | None) -> int:
        """What the request may generate: `None` asks for the rest of the context."""
        return self.max_model_len - num_prompt if requested is None else requested

    def _check_ids(self, field: str, ids: list[int]) -> None:
        for i, t in enumerate(ids):
            if not 0 <= t < self.vocab_size:
                raise InvalidRequest(
                    f"{field}[{i}] = {t} is outside the vocabulary [0, {self.vocab_size})"
                )

    def _check_length(self, num_prompt: int, max_tokens: int | None) -> None:
        if num_prompt >= self.max_model_len:
            raise InvalidRequest(
                f"the prompt has {num_prompt} tokens, but max_model_len is "
                f"{self.max_model_len}: shorten the prompt"
            )
        if max_tokens is not None and num_prompt + max_tokens > self.max_model_len:
            raise InvalidRequest(
                f"the prompt has {num_prompt} tokens and params.max_tokens is {max_tokens}: "
                f"together they exceed max_model_len {self.max_model_len}; lower max_tokens "
                f"to at most {self.max_model_len - num_prompt}"
            )

    def _chat_ids(self, messages: list) -> list[int]:
        if not messages:
            raise InvalidRequest("messages must not be empty")
        for i, m in enumerate(messages):
            if m.role not in CHAT_ROLES:
                roles = ", ".join(sorted(CHAT_ROLES))
                raise InvalidRequest(f"messages[{i}].role must be one of {roles}, got {m.role!r}")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidRequest("messages: this model has no chat template; send a prompt")
        conversation = [{"role": m.role, "content": m.content} for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # jinja templates raise their own errors for bad turns
            raise InvalidRequest(f"messages: the chat template refused them: {exc}") from exc
        # The template writes the special tokens (BOS included) itself.
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise InvalidRequest("messages must not be empty (they have no tokens)")
        return ids


def _check_request_id(request_id: str) -> None:
    if not request_id:
        raise InvalidRequest("client_request_id must not be empty")
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(
            f"client_request_id must be at most {MAX_REQUEST_ID_CHARS} characters"
        )


def salvage_request_id(frame: bytes | memoryview) -> str | None:
    """The client_request_id of a GenerateRequest frame the decoder refused, if readable.

    Lets a request that cannot be decoded (out-of-range sampling parameters, a frame over
    the size limit, a body cut short) be rejected by its id instead of leaving its client
    waiting. Only the frame's first bytes are read, so this is cheap at any size.
    """
    head = peek_head(frame, 2)
    if (head is not None and head[0] == kind_of(GenerateRequest) and type(head[1]) is str
            and 0 < len(head[1]) <= MAX_REQUEST_ID_CHARS):
        return head[1]
    return None

