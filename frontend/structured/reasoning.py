"""A thinking model's answer split into its reasoning and its content (the chat API's
`reasoning_content` and `content`), whole or streamed, for a server started with
`--reasoning-parser` (protocol.reasoning names the parsers and their block).

"qwen3": the reasoning is a `<think> ... </think>` block the answer opens with (after
whitespace); an answer that does not open with one is all content. "deepseek_r1": the prompt
opened the block, so the answer is reasoning up to `</think>` (a `<think>` it writes first
anyway is dropped). An unclosed block (cut by max_tokens) is all reasoning. The whitespace
between the block and the content is dropped. Streamed, text that may be the start of a tag
is held back until it is known, so a stream's pieces join into the whole answer's split.
"""

from __future__ import annotations

from frontend.structured.markers import partial_suffix
from protocol.reasoning import END, OPENS, START, check_parser


class ReasoningSplit:
    """Feeds streamed text; each piece comes back as (reasoning, content) text."""

    def __init__(self, parser: str) -> None:
        self.block = OPENS[check_parser(parser)]
        """Whether the answer has a reasoning block (known once it opens, for qwen3)."""
        self._state = "lead" if not self.block else "inside_lead"
        self._buffer = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._buffer += text
        reasoning = content = ""
        while self._buffer:
            if self._state in ("lead", "inside_lead"):  # a `<think>` may open the answer
                head = self._buffer.lstrip()
                if head.startswith(START):
                    self._buffer, self._state, self.block = head[len(START):], "inside", True
                elif START.startswith(head):  # may still become the tag
                    break
                else:
                    self._state = "content" if self._state == "lead" else "inside"
            elif self._state == "inside":
                at = self._buffer.find(END)
                if at < 0:
                    keep = partial_suffix(self._buffer, END)
                    reasoning += self._buffer[:len(self._buffer) - keep]
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    break
                reasoning += self._buffer[:at]
                self._buffer, self._state = self._buffer[at + len(END):], "gap"
            elif self._state == "gap":  # the whitespace between the block and the content
                self._buffer = self._buffer.lstrip()
                self._state = "content" if self._buffer else "gap"
            else:
                content, self._buffer = content + self._buffer, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held back, at the end of the answer."""
        rest, self._buffer = self._buffer, ""
        if self._state == "inside":
            return rest, ""
        if self._state == "lead":
            return "", rest
        return "", ""  # a lone `<think>` prefix, or whitespace after the block


def split_reasoning(text: str, parser: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole answer: reasoning None without a block, content None
    when the block is all there is."""
    split = ReasoningSplit(parser)
    r1, c1 = split.feed(text)
    r2, c2 = split.finish()
    if not split.block:
        return None, c1 + c2
    return r1 + r2, (c1 + c2) or None
