"""What the scheduler knows between calls, and the transitions that move a sequence.

The planner, the result processor and the request entry points all work on one
SchedulerState. Only the transitions here (preempt, finish, unlink) change which queue a
sequence is in or whether it holds blocks, so the bookkeeping each owes (blocks freed, prefix
hashed, drop announced to the workers) lives in one place.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from protocol import FinishReason
from protocol.engine_messages import EngineStats
from scheduler_proc.block_manager import BlockManager
from scheduler_proc.config import SchedulerConfig
from scheduler_proc.fair_share import WaitingQueues
from scheduler_proc.kv_tier import KVTier
from scheduler_proc.sequence import Sequence, SequenceStatus
from scheduler_proc.stats import SchedulerStats, request_metrics
from scheduler_proc.swap import discard, swap_out, swap_pays
from scheduler_proc.token_deltas_columns import TokenDeltasColumns

RUNNING = SequenceStatus.RUNNING
WAITING = SequenceStatus.WAITING
FINISHED = SequenceStatus.FINISHED


@dataclass(slots=True)
class PlanInFlight:
    """A plan sent and not answered yet."""

    step_id: int
    seqs: list[Sequence]
    """The sequences it samples for, in the order of its result."""
    seq_ids: list[int]
    """Their ids: a result that lists exactly these is matched by one comparison."""
    num_spec: list[int] = field(default_factory=list)
    """Proposals each of them may verify (aligned with seqs; empty when none speculates)."""


class SchedulerState:
    """Queues, plans in flight and buffered deltas; see Sequence for per-sequence accounting."""

    __slots__ = ("config", "block_manager", "kv_tier", "waiting", "running", "seqs", "next_step_id",
                 "inflight", "drops", "trims", "to_hash", "deltas", "stats", "handoffs")

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_manager = BlockManager(
            config.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.kv_tier = (KVTier(self.block_manager, config.num_host_slots)
                        if config.num_host_slots else None)
        """The host KV tier's index, swaps and the moves of the step being planned (None:
        off). Without prefix caching it only swaps: no block is hashed, so none is cached."""
        self.waiting = WaitingQueues()  # by client: scheduler_proc.fair_share
        self.running: list[Sequence] = []  # in admission order: the tail is preempted first
        self.seqs: dict[int, Sequence] = {}  # every unfinished sequence
        self.next_step_id = 0
        # Plans sent and not answered yet, oldest first.
        self.inflight: deque[PlanInFlight] = deque()
        # Ids the workers mirror but must forget; announced in the next plan.
        self.drops: list[int] = []
        # Block tables cut since the last plan (seq id -> blocks kept); announced in the next
        # plan, so every rank cuts its mirror at the same point of the plan stream.
        self.trims: dict[int, int] = {}
        # Sequences whose prefill chunk went into the last plan: their completed blocks enter
        # the prefix cache when the next plan is built, so a hit is only ever on KV written by
        # an earlier plan, never by a neighbour in the same batch.
        self.to_hash: list[Sequence] = []
        # Deltas not produced by a step (admission errors, aborts, refusals) wait here.
        self.deltas = TokenDeltasColumns()
        self.stats = SchedulerStats()
        self.handoffs = None
        """Prefill/decode hand-offs (scheduler_proc.handoff.Handoffs) on a replica with a role."""

    def unlink(self, seq: Sequence) -> None:
        """Take an unfinished sequence out of whichever queue holds it."""
        if seq.status is RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)

    def preempt(self, seq: Sequence) -> None:
        """Preemption: free everything, requeue at the front, re-send in full later.

        The caller has already taken it out of running. Where the rule says so
        (scheduler_proc.swap) its KV is first planned out to the host tier, to be loaded back
        on re-admission; otherwise it is recomputed then. Its computed full blocks are hashed
        first, so re-admission can hit them if they survive. Overlap hazard: a token sampled
        for it by a plan in flight still arrives and is appended (num_pending), and
        re-admission waits for it.
        """
        tier = self.kv_tier
        if tier is not None and swap_pays(seq, tier, self.config):
            swap_out(tier, seq)
        self.block_manager.hash_full_blocks(seq)
        self.block_manager.free(seq)
        self.trims.pop(seq.seq_id, None)  # the drop forgets the whole table
        self.stats.preemptions += 1
        seq.client.running -= 1
        seq.num_preemptions += 1
        seq.num_computed = 0
        seq.status = WAITING
        if seq.on_worker:
            self.drops.append(seq.seq_id)
            seq.on_worker = False
        self.waiting.appendleft(seq)

    def trim(self, seq: Sequence) -> None:
        """Free the blocks of a running sequence that were reserved for rejected proposals.

        Overlap hazard: a plan still in flight may write up to position num_computed +
        spec_inflight (its n is already counted, its proposals may all be accepted), so
        blocks up to there stay; only what lies past them and past the known tokens goes.
        The cut is announced in the next plan, which workers apply after every plan sent
        before it, so no rank frees a block that a plan it has not run yet still writes."""
        table = seq.block_table
        before = len(table)
        self.block_manager.free_tail(
            seq, max(seq.num_computed + seq.spec_inflight, len(seq.token_ids)))
        if len(table) < before:
            self.trims[seq.seq_id] = len(table)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Mark finished and free its blocks once; the caller unlinks it from its queue."""
        assert seq.status is not FINISHED, f"sequence {seq.seq_id} finished twice"
        if seq.block_table:
            self.block_manager.hash_full_blocks(seq)
            self.block_manager.free(seq)
        self.trims.pop(seq.seq_id, None)
        if seq.status is RUNNING:
            seq.client.running -= 1
        self.waiting.forget_if_idle(seq.client)
        if self.kv_tier is not None:
            discard(self.kv_tier, seq.seq_id)
        seq.status = FINISHED
        seq.finish_reason = reason
        metrics = request_metrics(seq, reason, time.monotonic())
        self.deltas.add_metrics(seq.seq_id, metrics)
        self.stats.record(metrics)
        if seq.on_worker:
            self.drops.append(seq.seq_id)
            seq.on_worker = False
        del self.seqs[seq.seq_id]


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
        steps_two_ahead=s.steps_two_ahead,
        **_tier_stats(state),
        **({} if state.handoffs is None else state.handoffs.stats_fields()),
        finished_by_reason=list(s.finished_by_reason),
        finished=s.take_records(),
    )


def _tier_stats(state: SchedulerState) -> dict[str, int]:
    tier = state.kv_tier
    if tier is None:
        return {}
    c = tier.counters
    return dict(host_hit_tokens=c.hit_tokens, host_blocks_stored=c.blocks_stored,
                host_blocks_loaded=c.blocks_loaded, host_blocks_used=tier.host.num_used,
                host_blocks_total=tier.host.num_slots, host_swaps_out=c.swaps_out,
                host_swaps_in=c.swaps_in, host_block_bytes=state.config.host_block_bytes)
