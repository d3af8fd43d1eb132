"""LLM.generate's prompts as users write them, made into one request each.

A prompt is a string, a list of token ids (numpy's integers and 1-D arrays too), or a dict
with "prompt" (a string) or "prompt_token_ids", as vLLM's TextPrompt and TokensPrompt are
written. `prompts` is one of those or a list (or any iterable) of them. A wrong shape is a
TypeError naming the prompt, raised before anything is sent; what a prompt holds (an empty
string, ids outside the vocabulary) is the tokenizer's to judge.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from typing import Any

from protocol.client_messages import as_token_ids

PROMPT_KEYS = ("prompt", "prompt_token_ids")
SHAPES = ('a string, a list of token ids or a {"prompt": ...} / {"prompt_token_ids": ...} '
          "dict")


def as_requests(prompts: Any) -> list[dict[str, Any]]:
    """One {"prompt": str} or {"prompt_token_ids": [int, ...]} per prompt, in order."""
    if _is_one_prompt(prompts):
        return [_request(prompts, "prompts")]
    if hasattr(prompts, "tolist"):  # a 2-D array: one prompt per row
        prompts = prompts.tolist()
    if not isinstance(prompts, Iterable):
        raise TypeError(f"prompts must be {SHAPES}, or a list of them; got "
                        f"{type(prompts).__name__}")
    return [_request(p, f"prompts[{i}]") for i, p in enumerate(prompts)]


def _is_one_prompt(value: Any) -> bool:
    if isinstance(value, str | Mapping):
        return True
    if getattr(value, "ndim", None) == 1:
        return True
    return isinstance(value, list | tuple) and bool(value) and _is_token_id(value[0])


def _is_token_id(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _request(prompt: Any, where: str) -> dict[str, Any]:
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, Mapping):
        if len(prompt) != 1 or next(iter(prompt)) not in PROMPT_KEYS:
            raise TypeError(f'{where} must hold one of "prompt" and "prompt_token_ids" and '
                            f"nothing else; got {sorted(map(str, prompt))}")
        [(key, value)] = prompt.items()
        where = f"{where}[{key!r}]"
        if key == "prompt_token_ids":
            return {"prompt_token_ids": _token_ids(value, where)}
        if not isinstance(value, str):
            raise TypeError(f"{where} must be a string; got {type(value).__name__}")
        return {"prompt": value}
    if hasattr(prompt, "tolist") or isinstance(prompt, list | tuple):
        return {"prompt_token_ids": _token_ids(prompt, where)}
    raise TypeError(f"{where} must be {SHAPES}; got {type(prompt).__name__}")


def _token_ids(value: Any, where: str) -> list[Any]:
    """The ids as ints; anything else stays, for the tokenizer to refuse by position."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if not isinstance(value, list | tuple):
        raise TypeError(f"{where} must be a list of token ids; got {type(value).__name__}")
    return as_token_ids(value)
