"""The most likely alternatives of each generated token, as the detokenizer passes them on."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Top:
    """Per token, its step's most likely tokens and their logprobs, best first."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]

    def cut(self, k: int) -> Top | None:
        """The first k of each token's alternatives (the step may carry more)."""
        if k <= 0:
            return None
        return Top([ids[:k] for ids in self.token_ids], [lps[:k] for lps in self.logprobs])


def joined(acc: Top | None, new: Top | None) -> Top | None:
    """`acc` with `new`'s tokens appended (a fresh Top when there was none)."""
    if new is None or acc is None:
        return acc or (Top(list(new.token_ids), list(new.logprobs)) if new else None)
    acc.token_ids.extend(new.token_ids)
    acc.logprobs.extend(new.logprobs)
    return acc
