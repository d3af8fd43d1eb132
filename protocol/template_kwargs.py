"""A chat request's extra chat-template variables (vLLM's `chat_template_kwargs`), such as
Qwen3's `enable_thinking`: what the template reads besides the messages.

They reach `apply_chat_template`, so only plain variables pass: names that are identifiers
and neither one of its own parameters (which would swap the template, tokenize, ...) nor a
special token's (`bos_token`...); values that are JSON scalars. They travel as JSON text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

FIELD = "chat_template_kwargs"
MAX_NAMES = 16
MAX_VALUE_CHARS = 1024
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
RESERVED = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "kwargs", "raise_exception", "strftime_now"})


class TemplateKwargsError(ValueError):
    """Bad chat_template_kwargs; the message names the variable."""


def checked(value: Any) -> dict[str, Any]:
    """The variables, or TemplateKwargsError saying which one cannot pass."""
    if not isinstance(value, Mapping):
        raise TemplateKwargsError(f"{FIELD} must be an object of template variables")
    if len(value) > MAX_NAMES:
        raise TemplateKwargsError(f"{FIELD} has {len(value)} variables; at most {MAX_NAMES}")
    out = {}
    for name, v in value.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise TemplateKwargsError(f"{FIELD}: {name!r} is not a variable name")
        if name in RESERVED or name.endswith("_token"):
            raise TemplateKwargsError(f"{FIELD}.{name} is not a template variable a request may "
                                      "set (it is the chat template call's own or a special "
                                      "token's)")
        if not (v is None or isinstance(v, bool | int | float | str)):
            raise TemplateKwargsError(f"{FIELD}.{name} must be a string, number, boolean or "
                                      "null")
        if isinstance(v, str) and len(v) > MAX_VALUE_CHARS:
            raise TemplateKwargsError(f"{FIELD}.{name} is over {MAX_VALUE_CHARS} characters")
        out[name] = v
    return out


def to_text(value: Mapping[str, Any] | None) -> str:
    """The wire's text: "" for none."""
    return "" if not value else json.dumps(checked(value), separators=(",", ":"))


def from_text(text: str) -> dict[str, Any]:
    if not text:
        return {}
    try:
        return checked(json.loads(text))
    except ValueError as exc:  # TemplateKwargsError, or text that is not JSON
        raise TemplateKwargsError(str(exc) if isinstance(exc, TemplateKwargsError)
                                  else f"{FIELD} is not JSON: {exc}") from None
