"""Size limits that refuse a request which cannot fit max_model_len before it is tokenized.

Tokenizing costs time and memory in proportion to the text (a 50 MB prompt once took a
tokenizer to 12 GB), so a prompt is first measured in bytes against a bound that only a
prompt with at least max_model_len tokens can exceed.

Why the bound is safe. Every token of the vocabulary stands for at most `L` bytes of input
text, where L is the longest UTF-8 spelling of a vocabulary entry: byte-level BPE (GPT-2,
Llama 3, Qwen) spells each byte as one character of one or two UTF-8 bytes, sentencepiece
pieces spell a space as "▁" (three bytes for one) and a fallback byte as "<0x41>" (six for
one), and added tokens ("<|im_start|>") are spelled as the text they match. So N bytes of
text need at least N / L tokens, unless the tokenizer's normalizer shrinks the text first:
Unicode composition (NFC, NFKC) shrinks it at most threefold (three Hangul jamo, nine bytes,
compose into one three-byte syllable), so a tokenizer with a normalizer gets L times
NORMALIZER_SHRINK. Two cases stay outside the guarantee, and are refused although they
might fit: text that a normalizer deletes (a Strip of megabytes of spaces), and runs of
characters that a model without byte fallback fuses into one unknown token.

Chat messages are bounded by the sum of their contents: a template adds text around each
turn and never fewer tokens than the contents need (a template that drops content, as
Qwen3's drops earlier reasoning, may turn a refused conversation into one that fits; the
client can drop that content itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from frontend.actors.request_validation import InvalidRequest
from protocol import MAX_FRAME_BYTES, GenerateRequest

NORMALIZER_SHRINK = 3
"""How many times shorter a normalizer can make text (Unicode composition, worst case)."""
FRAME_SLACK_BYTES = 1 << 20
"""Room in a request frame for everything but the prompt (sampling parameters, stop strings,
msgpack headers of the chat turns)."""
MAX_TOKEN_ID_BYTES = 9
"""The largest msgpack encoding of one token id (a 64-bit integer)."""


@dataclass(frozen=True)
class PromptLimits:
    max_model_len: int
    bytes_per_token: int
    """The most bytes of text one token can stand for (L above, normalizer included)."""

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, max_model_len: int) -> PromptLimits:
        return cls(max_model_len, max_bytes_per_token(tokenizer))

    @property
    def max_text_bytes(self) -> int:
        """Text longer than this has at least max_model_len tokens (a prompt needs fewer)."""
        return self.bytes_per_token * (self.max_model_len - 1)

    @property
    def max_frame_bytes(self) -> int:
        """The largest GenerateRequest frame that can hold a prompt that fits."""
        prompt = max(self.max_text_bytes, MAX_TOKEN_ID_BYTES * self.max_model_len)
        return min(MAX_FRAME_BYTES, prompt + FRAME_SLACK_BYTES)

    def check(self, req: GenerateRequest) -> None:
        """Refuse a prompt that cannot fit, by its size alone (nothing is tokenized)."""
        if req.prompt is not None:
            self._check_text("prompt", _utf8_len(req.prompt))
        if req.prompt_token_ids is not None and len(req.prompt_token_ids) >= self.max_model_len:
            raise InvalidRequest(
                "prompt_token_ids", f"prompt_token_ids has {len(req.prompt_token_ids)} tokens, "
                f"but max_model_len is {self.max_model_len}: shorten the prompt")
        if req.messages is not None:
            self._check_text("messages", sum(_utf8_len(m.content) for m in req.messages))

    def _check_text(self, field: str, size: int) -> None:
        if size > self.max_text_bytes:
            raise InvalidRequest(
                field, f"{field} is {size} bytes: text over {self.max_text_bytes} bytes has at "
                f"least max_model_len ({self.max_model_len}) tokens with this tokenizer (a token "
                f"stands for at most {self.bytes_per_token} bytes); shorten the {field}")

    def frame_error(self, size: int) -> str:
        return (f"the request is {size} bytes, over the {self.max_frame_bytes} bytes that a "
                f"prompt of fewer than max_model_len ({self.max_model_len}) tokens needs; "
                f"shorten the prompt")


def max_bytes_per_token(tokenizer: Any) -> int:
    """L: the longest UTF-8 spelling in the vocabulary, times NORMALIZER_SHRINK when the
    tokenizer normalizes its input."""
    longest = max((len(token.encode("utf-8", "surrogatepass"))
                   for token in tokenizer.get_vocab()), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        longest *= NORMALIZER_SHRINK  # a slow tokenizer's normalization is unknown
    return max(1, longest)


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
