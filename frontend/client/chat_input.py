"""Chat messages as users write them, checked where they are given.

A message is a {"role", "content"} dict (or a ChatMessage); its content is a string or a list
of OpenAI-style text parts, which are joined with newlines. An assistant message's OpenAI
`tool_calls` become the Hermes <tool_call> text the model would have written. A wrong shape
is a TypeError that names the message, raised by the call that was given it. Which roles a
model takes is for the tokenizer to judge: it knows the model and answers every client,
HTTP's too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from frontend.structured.tool_calls import render_tool_calls
from protocol import ChatMessage


def as_chat_messages(value: Any, where: str = "messages") -> list[ChatMessage]:
    """A list of messages as ChatMessages (an empty one is the tokenizer's to refuse)."""
    if isinstance(value, str | Mapping) or not isinstance(value, Sequence):
        raise TypeError(f'{where} must be a list of {{"role", "content"}} dicts, got '
                        f"{type(value).__name__}")
    return [as_chat_message(m, f"{where}[{i}]") for i, m in enumerate(value)]


def as_chat_message(message: Any, where: str) -> ChatMessage:
    if isinstance(message, ChatMessage):
        return message
    if not isinstance(message, Mapping):
        raise TypeError(f'{where} must be a {{"role", "content"}} dict, got '
                        f"{type(message).__name__}")
    role = message.get("role")
    if not isinstance(role, str):
        raise TypeError(f"{where}.role must be a string, got {role!r}")
    calls = message.get("tool_calls")
    if calls:  # an assistant turn's OpenAI tool calls, written as the model writes them
        if not isinstance(calls, list) or not all(isinstance(c, Mapping) for c in calls):
            raise TypeError(f"{where}.tool_calls must be a list of tool call dicts")
        text = _text(message.get("content") or "", where)
        return ChatMessage(role, "\n".join(t for t in (text, render_tool_calls(calls)) if t))
    return ChatMessage(role, _text(message.get("content"), where))


def _text(content: Any, where: str) -> str:
    if isinstance(content, list):  # OpenAI-style parts: only text ones are understood
        texts = []
        for k, part in enumerate(content):
            if not (isinstance(part, Mapping) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise TypeError(f'{where}.content[{k}] must be a {{"type": "text", "text": ...}}'
                                " part")
            texts.append(part["text"])
        content = "\n".join(texts)
    if not isinstance(content, str):
        raise TypeError(f"{where}.content must be a string or a list of text parts")
    return content
