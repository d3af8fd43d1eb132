"""Column buffers that collect one TokenDeltas message, row by row."""

from __future__ import annotations

from protocol import FinishReason, RequestError, RequestMetrics, StepResult, TokenDeltas

NO_LOGPROBS: list[float] = []
"""The logprobs of a row whose step has none: one shared list, never mutated (the message
leaves the column out)."""


class TokenDeltasColumns:
    """Column buffers for one TokenDeltas message.

    Columns rather than row objects because the message is column-oriented on the wire, and
    a step's result fills them from its own columns at once (add_sampled).
    """

    __slots__ = ("ids", "tokens", "reasons", "errors", "logprobs", "top_ids", "top_lps",
                 "metrics_ids", "metrics", "handoff_ids", "continued_ids")

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.tokens: list[list[int]] = []
        self.reasons: list[FinishReason | None] = []
        self.errors: list[RequestError | None] = []
        self.logprobs: list[list[float]] = []
        # Filled only once a step brings top alternatives; padded for the rows before it.
        self.top_ids: list[list[list[int]]] = []
        self.top_lps: list[list[list[float]]] = []
        self.metrics_ids: list[int] = []
        self.metrics: list[RequestMetrics] = []
        self.handoff_ids: list[int] = []
        self.continued_ids: list[int] = []

    def pad_top(self) -> None:
        missing = len(self.ids) - len(self.top_ids)
        self.top_ids.extend([] for _ in range(missing))
        self.top_lps.extend([] for _ in range(missing))

    def add(
        self,
        rid: int,
        tokens: list[int],
        reason: FinishReason | None,
        error: RequestError | None,
        logprob: float | None = None,
    ) -> None:
        self.ids.append(rid)
        self.tokens.append(tokens)
        self.reasons.append(reason)
        self.errors.append(error)
        self.logprobs.append([] if logprob is None else [logprob])

    def add_sampled(self, result: StepResult, skipped: list[int],
                    finishes: list[tuple[int, FinishReason]]) -> int:
        """A row per entry of a one-token-per-entry result, but the `skipped` entries: its id,
        its token, and its logprob and alternatives when the step has them. `finishes` names
        the rows (counted from the first one added) that finished and why. Returns how many
        rows were added. Built from the result's columns at once: one call per step."""
        ids, tokens = result.seq_ids, result.token_ids
        logprobs, top_ids, top_lps = result.logprobs, result.top_token_ids, result.top_logprobs
        if top_ids is not None:
            self.pad_top()
        entries: range | list[int] = range(len(ids))
        if skipped:
            gone = set(skipped)
            entries = [k for k in entries if k not in gone]
            ids = [ids[k] for k in entries]
            tokens = [tokens[k] for k in entries]
        start = len(self.ids)
        self.ids.extend(ids)
        self.tokens.extend([[t] for t in tokens])
        self.reasons.extend([None] * len(ids))
        for row, reason in finishes:
            self.reasons[start + row] = reason
        self.errors.extend([None] * len(ids))
        if logprobs is None:
            self.logprobs.extend([NO_LOGPROBS] * len(ids))
        else:
            self.logprobs.extend([[logprobs[k]] for k in entries])
        if top_ids is not None:
            self.top_ids.extend([[top_ids[k]] for k in entries])
            self.top_lps.extend([[top_lps[k]] for k in entries])
        return len(ids)

    def add_metrics(self, rid: int, metrics: RequestMetrics) -> None:
        """A request finished; its row (added before or after) is in the same message."""
        self.metrics_ids.append(rid)
        self.metrics.append(metrics)

    def take(self, step_id: int, with_logprobs: bool | None) -> TokenDeltas | None:
        """Empty the buffer into a message. with_logprobs=None: only if non-empty."""
        if with_logprobs is None and not (self.ids or self.continued_ids):
            return None
        if self.top_ids:
            self.pad_top()
        msg = TokenDeltas(
            step_id,
            self.ids,
            self.tokens,
            self.reasons,
            self.errors,
            self.logprobs if with_logprobs else None,
            *((self.top_ids, self.top_lps) if self.top_ids and with_logprobs else (None, None)),
            self.metrics_ids,
            self.metrics,
            self.handoff_ids,
            self.continued_ids,
        )
        self.__init__()
        return msg
