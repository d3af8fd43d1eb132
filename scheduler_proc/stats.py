"""The scheduler's counters: plain integer adds where the events already happen.

The step loop only increments; the deltas publisher's thread reads them every
STATS_INTERVAL_S into an EngineStats (snapshot), so the loop never builds, sends or locks
anything for stats. The reads are not atomic as a whole (one counter may be a step ahead of
another); every single read is, which is all a rate needs.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from protocol.engine_messages import EngineStats

if TYPE_CHECKING:
    from scheduler_proc.state import SchedulerState


class SchedulerStats:
    """Cumulative since start; see EngineStats for what each counts."""

    __slots__ = ("prompt_tokens", "cached_prompt_tokens", "generated_tokens", "preemptions",
                 "finished_requests", "schedule_time_s", "result_time_s",
                 "spec_proposed_tokens", "spec_accepted_tokens", "gpu_busy_s")

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


def snapshot(state: SchedulerState) -> EngineStats:
    """The counters and the gauges now (safe to call from another thread of the process)."""
    s = state.stats
    bm = state.block_manager
    return EngineStats(
        time_s=time.monotonic(),
        steps=state.next_step_id,
        prompt_tokens=s.prompt_tokens,
        cached_prompt_tokens=s.cached_prompt_tokens,
        generated_tokens=s.generated_tokens,
        preemptions=s.preemptions,
        finished_requests=s.finished_requests,
        schedule_time_s=s.schedule_time_s,
        result_time_s=s.result_time_s,
        running=len(state.running),
        waiting=len(state.waiting),
        kv_blocks_used=bm.num_blocks - bm.num_free,
        kv_blocks_total=bm.num_blocks,
        spec_proposed_tokens=s.spec_proposed_tokens,
        spec_accepted_tokens=s.spec_accepted_tokens,
        gpu_busy_s=s.gpu_busy_s,
    )
