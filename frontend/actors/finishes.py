"""How a request's end reads to its client: which tokens have text, and the finish reason
its metrics give when the detokenizer, not the scheduler, ended it."""

from __future__ import annotations

import dataclasses

from protocol import FinishReason, RequestMetrics

STOP = FinishReason.STOP


def text_token_ids(token_ids: list[int], finish: FinishReason | None) -> list[int]:
    """The tokens whose text the client sees: a request stopped by EOS or a stop token id
    keeps that last token but not its text."""
    return token_ids[:-1] if finish is STOP and token_ids else token_ids


def ended_at_stop(metrics: RequestMetrics | None) -> RequestMetrics | None:
    """The metrics of a request ended at a stop string. The scheduler may have ended it at
    max_tokens first (in the step that brought the stop, or before the abort reached it),
    but the client was told "stop", and its metrics say the same."""
    return metrics and dataclasses.replace(metrics, finish_reason=STOP)
