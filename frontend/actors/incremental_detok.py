"""Turn a growing list of token ids into text deltas that are always safe to show.

Two things make this harder than `decode(new_ids)`:
- Spacing. Sentencepiece drops the leading space of the first token of a decode, and
  byte-level BPE merges can depend on neighbours, so a token decoded alone can differ from
  the same token decoded in context. We decode a small window that starts a few tokens
  back (`prefix`), decode it again with the new tokens, and emit the difference.
- Broken characters. A multi-byte UTF-8 character (an emoji, CJK) may be split over
  several tokens; until it is complete the decode ends in U+FFFD. Such text is held back
  until a later token completes it, or until the request finishes.

Stop strings are matched on the decoded text: the earliest match anywhere in the new text
(also across deltas) ends the request, the stop string itself is not emitted (unless asked
for: include_stop), and a tail that could still grow into a stop string is held back until it
cannot.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

DecodeFn = Callable[[list[int], bool], str]
"""decode(token_ids, skip_special_tokens) -> text"""

REPLACEMENT_CHAR = "\ufffd"
PROMPT_TAIL_TOKENS = 6
"""How many prompt tokens the tokenizer sends so the first generated word is spaced right."""
_TRIM_AT = 256


def make_decode_fn(tokenizer: Any) -> DecodeFn:
    """The fastest faithful decode the tokenizer offers (the Rust one for fast tokenizers)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(
        ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False
    )


def context_anchor(tokenizer: Any) -> list[int]:
    """One ordinary token to decode in front of text whose real context is unknown (a watcher
    that never saw the prompt, or joined mid-request): sentencepiece strips the leading space
    of whatever comes first in a decode, so the first word would otherwise lose its space."""
    return tokenizer.encode("a", add_special_tokens=False)[-1:]


class IncrementalDetokenizer:
    """Decoding state of one request."""

    def __init__(self, decode: DecodeFn, prompt_tail: Sequence[int] = (), *,
                 skip_special_tokens: bool = True, stop: Sequence[str] = (),
                 include_stop: bool = False) -> None:
        self._decode = decode
        self._skip = skip_special_tokens
        self._tokens: list[int] = list(prompt_tail)
        # _tokens[_prefix:_read] were decoded already (context only); _tokens[_read:] are
        # tokens whose text has not been released yet.
        self._prefix = 0
        self._read = len(self._tokens)
        self._stop = tuple(stop)
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self._include_stop = include_stop
        self.text = ""
        """All text decoded so far, cut before the stop string once one matched (after it
        with `include_stop`)."""
        self._emitted = 0
        self.stop_matched: str | None = None

    @property
    def finished(self) -> bool:
        return self.stop_matched is not None

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed new tokens; return the text that may be shown now (maybe empty)."""
        if self.finished:
            return ""
        self._tokens.extend(token_ids)
        self._append(self._decode_pending(final=False))
        return self._release(final=False)

    def flush(self) -> str:
        """The request ended: release everything held back, broken characters included."""
        if self.finished:
            return ""
        self._append(self._decode_pending(final=True))
        return self._release(final=True)

    def _decode_pending(self, final: bool) -> str:
        if self._read == len(self._tokens):
            return ""
        window = self._tokens[self._prefix:]
        prefix_text = self._decode(window[: self._read - self._prefix], self._skip)
        full_text = self._decode(window, self._skip)
        if not final and (len(full_text) <= len(prefix_text)
                          or full_text.endswith(REPLACEMENT_CHAR)):
            return ""  # an incomplete character, or nothing visible yet
        self._prefix = self._read
        self._read = len(self._tokens)
        if self._prefix > _TRIM_AT:
            del self._tokens[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return full_text[len(prefix_text):]

    def _append(self, new_text: str) -> None:
        if not new_text:
            return
        old_len = len(self.text)
        self.text += new_text
        if not self._stop:
            return
        start = max(0, old_len - self._max_stop + 1)
        best = -1
        for s in self._stop:
            i = self.text.find(s, start)
            if i != -1 and (best == -1 or i < best):
                best, self.stop_matched = i, s
        if best != -1:
            kept = len(self.stop_matched) if self._include_stop else 0
            self.text = self.text[:best + kept]

    def _release(self, final: bool) -> str:
        end = len(self.text)
        if not final and not self.finished and self._stop:
            end -= self._stop_prefix_len()
        if end <= self._emitted:
            return ""
        out = self.text[self._emitted:end]
        self._emitted = end
        return out

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        text, best = self.text, 0
        last = text[-1:] if text else ""
        if not last:
            return 0
        for s in self._stop:
            i = s.find(last, 0, len(s) - 1)
            while i != -1:
                k = i + 1
                if k > best and k <= len(text) - self._emitted and text.endswith(s[:k]):
                    best = k
                i = s.find(last, i + 1, len(s) - 1)
        return best
