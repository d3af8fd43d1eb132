"""Per-request metrics: what the scheduler measured about one request, carried on its final
TokenDeltas to the client and in EngineStats to whoever follows the engine's counters.

Durations are measured on the scheduler's monotonic clock from the request's arrival, which
the tokenizer stamps on the wall clock when the request's frame arrives (AddRequest carries
it); the scheduler converts it once, on receipt, so a wall-clock jump later cannot make a
duration negative.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.codec import struct
from protocol.outcomes import FinishReason


@struct
@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """Timings and cache use of one finished request (seconds)."""

    arrival_time: float
    """Wall clock (time.time()) when the tokenizer received the request."""
    queue_time_s: float | None
    """Arrival -> first scheduled (tokenizing included); None if it never was."""
    ttft_s: float | None
    """Arrival -> first generated token; None if it generated none."""
    tpot_s: float | None
    """Mean time between generated tokens after the first; None with fewer than two."""
    e2e_s: float
    """Arrival -> finished."""
    prompt_tokens: int
    cached_prompt_tokens: int
    """Prompt tokens served from the prefix cache when the request was first scheduled."""
    generated_tokens: int
    preemptions: int
    finish_reason: FinishReason
    spec_proposed_tokens: int = 0
    """Speculative decoding: proposed tokens the model verified for this request (0 without)."""
    spec_accepted_tokens: int = 0
    """Of those, the ones it accepted (the request's acceptance rate: accepted / proposed)."""
    host_prompt_tokens: int = 0
    """Of cached_prompt_tokens, those loaded from the host KV tier (the rest were on the
    device)."""
    kv_transfer_s: float | None = None
    """Disaggregation: the time its KV took to move from the prefill to the decode replica
    (blocks accepted -> landed on every rank); None when it was not handed off."""

    @property
    def first_scheduled_time(self) -> float | None:
        """Wall clock of the first scheduling (arrival_time + queue_time_s)."""
        return None if self.queue_time_s is None else self.arrival_time + self.queue_time_s

    @property
    def first_token_time(self) -> float | None:
        return None if self.ttft_s is None else self.arrival_time + self.ttft_s

    @property
    def finished_time(self) -> float:
        return self.arrival_time + self.e2e_s
