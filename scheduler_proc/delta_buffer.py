"""Column buffers that collect one TokenDeltas message, row by row."""

from __future__ import annotations

from protocol import FinishReason, RequestError, RequestMetrics, TokenDeltas


class DeltaBuffer:
    """Column buffers for one TokenDeltas message.

    Columns rather than row objects because the message is column-oriented on the wire, and
    the result loop appends to them directly (bound `append`s) once per decoding sequence.
    """

    __slots__ = ("ids", "tokens", "reasons", "errors", "logprobs", "top_ids", "top_lps",
                 "metrics_ids", "metrics")

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

    def add_metrics(self, rid: int, metrics: RequestMetrics) -> None:
        """A request finished; its row (added before or after) is in the same message."""
        self.metrics_ids.append(rid)
        self.metrics.append(metrics)

    def take(self, step_id: int, with_logprobs: bool | None) -> TokenDeltas | None:
        """Empty the buffer into a message. with_logprobs=None: only if non-empty."""
        if with_logprobs is None and not self.ids:
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
        )
        self.__init__()
        return msg
