"""The scheduler's counters: plain integer adds where the events already happen.

The step loop only increments; the deltas publisher's thread reads them every
STATS_INTERVAL_S, and soon after a step finishes requests, into an EngineStats
(scheduler_proc.state.snapshot), so the loop never builds, sends or locks anything for stats.
The reads are not atomic as a whole (one counter may be a step ahead of another); every single
read is, which is all a rate needs.

A finished request's RequestMetrics also waits here, in a deque (appends and pops are atomic
across threads), until the next snapshot takes it.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from protocol import FinishReason, RequestMetrics

if TYPE_CHECKING:
    from scheduler_proc.sequence import Sequence

MAX_UNPUBLISHED_RECORDS = 100_000
"""Records kept for the next snapshot; past it the oldest go (nobody is taking them)."""


class SchedulerStats:
    """Cumulative since start; see EngineStats for what each counts."""

    __slots__ = ("prompt_tokens", "cached_prompt_tokens", "generated_tokens", "preemptions",
                 "finished_requests", "schedule_time_s", "result_time_s",
                 "spec_proposed_tokens", "spec_accepted_tokens", "gpu_busy_s",
                 "steps_two_ahead", "finished_by_reason", "records")

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.generated_tokens = 0
        self.preemptions = 0
        self.finished_requests = 0
        self.schedule_time_s = 0.0
        self.result_time_s = 0.0
        self.spec_proposed_tokens = 0
        self.spec_accepted_tokens = 0
        self.gpu_busy_s = 0.0
        self.steps_two_ahead = 0
        self.finished_by_reason = [0] * len(FinishReason)
        self.records: deque[RequestMetrics] = deque(maxlen=MAX_UNPUBLISHED_RECORDS)

    def record(self, metrics: RequestMetrics) -> None:
        self.finished_requests += 1
        self.finished_by_reason[metrics.finish_reason] += 1
        self.records.append(metrics)

    def take_records(self) -> list[RequestMetrics]:
        """The records since the last call (any thread; each record is taken once)."""
        out = []
        pop = self.records.popleft
        while True:
            try:
                out.append(pop())
            except IndexError:
                return out


def request_metrics(seq: Sequence, reason: FinishReason, now: float) -> RequestMetrics:
    """What `seq`, finishing now (monotonic), measured."""
    arrival = seq.arrival_s
    scheduled, first = seq.first_scheduled_s, seq.first_token_s
    n = seq.num_generated
    return RequestMetrics(
        arrival_time=seq.arrival_time,
        queue_time_s=None if scheduled is None else scheduled - arrival,
        ttft_s=None if first is None else first - arrival,
        tpot_s=(seq.last_token_s - first) / (n - 1) if first is not None and n > 1 else None,
        e2e_s=now - arrival,
        prompt_tokens=seq.num_prompt_tokens,
        cached_prompt_tokens=seq.num_cached_prompt,
        generated_tokens=n,
        preemptions=seq.num_preemptions,
        finish_reason=reason,
        spec_proposed_tokens=seq.spec_proposed,
        spec_accepted_tokens=seq.spec_accepted,
        host_prompt_tokens=seq.num_host_prompt,
        kv_transfer_s=seq.kv_transfer_s,
    )

