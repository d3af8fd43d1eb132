"""What the scheduler knows between calls, and the transitions that move a sequence.

The planner, the result processor and the request entry points all work on one
SchedulerState. Only the transitions here (preempt, finish, unlink) change which queue a
sequence is in or whether it holds blocks, so the bookkeeping each owes (blocks freed, prefix
hashed, drop announced to the workers) lives in one place.
"""

from __future__ import annotations

import time
from collections import deque

from protocol import FinishReason
from scheduler_proc.block_manager import BlockManager
from scheduler_proc.config import SchedulerConfig
from scheduler_proc.delta_buffer import DeltaBuffer
from scheduler_proc.sequence import Sequence, SequenceStatus
from scheduler_proc.stats import SchedulerStats, request_metrics

RUNNING = SequenceStatus.RUNNING
WAITING = SequenceStatus.WAITING
FINISHED = SequenceStatus.FINISHED


class SchedulerState:
    """Queues, plans in flight and buffered deltas; see Sequence for per-sequence accounting."""

    __slots__ = ("config", "block_manager", "waiting", "running", "seqs", "next_step_id",
                 "inflight", "drops", "to_hash", "deltas", "stats")

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_manager = BlockManager(
            config.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the tail is preempted first
        self.seqs: dict[int, Sequence] = {}  # every unfinished sequence
        self.next_step_id = 0
        # Plans sent and not answered yet: (step id, sequences expected to sample, in plan order).
        self.inflight: deque[tuple[int, list[Sequence]]] = deque()
        # Ids the workers mirror but must forget; announced in the next plan.
        self.drops: list[int] = []
        # Sequences whose prefill chunk went into the last plan: their completed blocks enter
        # the prefix cache when the next plan is built, so a hit is only ever on KV written by
        # an earlier plan, never by a neighbour in the same batch.
        self.to_hash: list[Sequence] = []
        # Deltas not produced by a step (admission errors, aborts, refusals) wait here.
        self.deltas = DeltaBuffer()
        self.stats = SchedulerStats()

    def unlink(self, seq: Sequence) -> None:
        """Take an unfinished sequence out of whichever queue holds it."""
        if seq.status is RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)

    def preempt(self, seq: Sequence) -> None:
        """Recompute-preemption: free everything, requeue at the front, re-send in full later.

        The caller has already taken it out of running. Its computed full blocks are hashed
        first, so re-admission can hit them if they survive. Overlap hazard: a token sampled
        for it by a plan in flight still arrives and is appended (num_pending), and
        re-admission waits for it.
        """
        self.block_manager.hash_full_blocks(seq)
        self.block_manager.free(seq)
        self.stats.preemptions += 1
        seq.num_preemptions += 1
        seq.num_computed = 0
        seq.status = WAITING
        if seq.on_worker:
            self.drops.append(seq.seq_id)
            seq.on_worker = False
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Mark finished and free its blocks once; the caller unlinks it from its queue."""
        assert seq.status is not FINISHED, f"sequence {seq.seq_id} finished twice"
        if seq.block_table:
            self.block_manager.hash_full_blocks(seq)
            self.block_manager.free(seq)
        seq.status = FINISHED
        seq.finish_reason = reason
        metrics = request_metrics(seq, reason, time.monotonic())
        self.deltas.add_metrics(seq.seq_id, metrics)
        self.stats.record(metrics)
        if seq.on_worker:
            self.drops.append(seq.seq_id)
            seq.on_worker = False
        del self.seqs[seq.seq_id]
