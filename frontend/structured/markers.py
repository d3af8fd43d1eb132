"""Streamed text held back while its end may still be the start of a marker (`<tool_call>`,
`</think>`), so no piece of a marker leaks into the text sent on."""

from __future__ import annotations


def partial_suffix(text: str, marker: str) -> int:
    """How many last characters of text are a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
