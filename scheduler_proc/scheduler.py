"""The scheduler: which tokens of which sequences each step computes, and what they produced.

Overlap: the process loop calls schedule() for step N+1 *before* process_result(N). So
schedule() advances num_computed when it plans, and plans every decoding sequence as if
it survives step N: its input for N+1 is the token N samples, which the workers already
hold (Sequence.num_pending counts such tokens). The hazards this creates are handled where
marked "Overlap hazard" (state, step_planner, step_results). With overlap off the loop simply
alternates the two calls.

This class is the API the process loop and the tests drive; the work is done by admission
(judging requests), step_planner (building plans), step_results (applying results) and the
transitions of SchedulerState.
"""

from __future__ import annotations

import time

from protocol import (
    OUT_OF_BAND_STEP,
    AddRequest,
    FinishReason,
    RequestError,
    StepPlan,
    StepResult,
    TokenDeltas,
)
from protocol.engine_messages import EngineStats
from protocol.kv_handoff import (
    HandoffAccept,
    HandoffCancel,
    HandoffOffer,
    HandoffPeerDown,
    HandoffRelease,
    KVLanded,
)
from scheduler_proc.admission import admission_error, with_resolved_max_tokens
from scheduler_proc.block_manager import BlockManager
from scheduler_proc.config import SchedulerConfig
from scheduler_proc.fair_share import WaitingQueues
from scheduler_proc.handoff import Handoffs
from scheduler_proc.handoff_faults import fail_all, on_peer_down
from scheduler_proc.invariants import check_integrity
from scheduler_proc.plans_in_flight import PacingMeter, PlanDepth
from scheduler_proc.sequence import Sequence
from scheduler_proc.state import SchedulerState, snapshot
from scheduler_proc.step_planner import plan_step
from scheduler_proc.step_results import apply_result

ABORT, ERROR = FinishReason.ABORT, FinishReason.ERROR


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.state = SchedulerState(config)
        self.handoffs: Handoffs | None = None
        if config.role:
            self.handoffs = self.state.handoffs = Handoffs(self.state)
        self.depth = PlanDepth.from_config(config)
        """How many plans may be in flight, and when (scheduler_proc.plans_in_flight)."""

    # Read-only views of the state, for the process loop, benchmarks and tests.
    @property
    def config(self) -> SchedulerConfig:
        return self.state.config

    @property
    def pacing(self) -> PacingMeter | None:
        """The depth rule's meter; set None to let the batch alone decide the depth."""
        return self.depth.meter

    @pacing.setter
    def pacing(self, meter: PacingMeter | None) -> None:
        self.depth.meter = meter

    @property
    def block_manager(self) -> BlockManager:
        return self.state.block_manager

    @property
    def waiting(self) -> WaitingQueues:
        """Every waiting sequence, by client (scheduler_proc.fair_share)."""
        return self.state.waiting

    @property
    def running(self) -> list[Sequence]:
        return self.state.running

    @property
    def seqs(self) -> dict[int, Sequence]:
        """Every unfinished sequence, by id."""
        return self.state.seqs

    # ------------------------------------------------------------------ requests

    def add_request(self, req: AddRequest) -> None:
        """Queue a request, or finish it at once with an error delta if it can never run."""
        state = self.state
        error = admission_error(req, state.config, state.block_manager,
                                req.request_id in state.seqs)
        if error is not None:
            state.deltas.add(req.request_id, [], ERROR, error)
            return
        req = with_resolved_max_tokens(req, state.config.max_model_len)
        seq = Sequence(req.request_id, req.prompt_token_ids, req.params, req.eos_token_ids,
                       req.arrival_time, state.config.max_model_len)
        if state.config.role == "prefill":
            seq.decode_replica = req.decode_replica
        seq.client = state.waiting.client(req.client_key)
        state.seqs[seq.seq_id] = seq
        state.waiting.append(seq)

    def abort(self, request_ids: list[int], reason: FinishReason = ABORT) -> None:
        """Finish requests now and free every block they hold.

        Overlap hazard: an aborted sequence may still be in plans in flight; the tokens their
        results carry for it are ignored (it is FINISHED), and its blocks are only reused by
        plans sent after those, which workers run strictly later.
        """
        state = self.state
        for rid in request_ids:
            seq = state.seqs.get(rid)
            if seq is None and self.handoffs is not None:
                self._abort_handoff(rid, reason)
                continue
            if seq is None:  # already finished, or never admitted: nothing to do
                continue
            state.unlink(seq)
            state.finish(seq, reason)
            state.deltas.add(rid, [], reason, None)

    def fail_all(self, error: RequestError) -> TokenDeltas | None:
        """Finish every unfinished request with an error delta (e.g. the engine died)."""
        state = self.state
        for seq in list(state.seqs.values()):
            state.finish(seq, ERROR)
            state.deltas.add(seq.seq_id, [], ERROR, error)
        if self.handoffs is not None:
            fail_all(self.handoffs, error)
        state.running.clear()
        state.waiting.clear()
        state.inflight.clear()
        state.to_hash.clear()
        return self.pop_deltas()

    def _abort_handoff(self, rid: int, reason: FinishReason) -> None:
        """An abort for a request in a hand-off here, or not here (yet)."""
        handoffs = self.handoffs
        seq = handoffs.seqs.get(rid)
        if seq is None:
            if handoffs.role == "decode":
                handoffs.refuse(rid)  # its offer may be on its way
        elif handoffs.owns(seq):
            handoffs.end(seq, reason, None)
        else:
            handoffs.drop(seq)  # the prefill replica reports its end

    def on_handoff(self, msg: object) -> None:
        """A hand-off message from another replica's scheduler or from a rank."""
        handoffs = self.handoffs
        if handoffs is None:
            return
        if isinstance(msg, HandoffOffer):
            handoffs.on_offer(msg)
        elif isinstance(msg, HandoffAccept):
            handoffs.on_accept(msg)
        elif isinstance(msg, HandoffRelease):
            handoffs.on_release(msg)
        elif isinstance(msg, HandoffCancel):
            handoffs.on_cancel(msg)
        elif isinstance(msg, KVLanded):
            handoffs.on_landed(msg)
        elif isinstance(msg, HandoffPeerDown):
            on_peer_down(handoffs, msg)

    def has_unfinished(self) -> bool:
        return bool(self.state.seqs) or (self.handoffs is not None and bool(self.handoffs.seqs))

    def has_inflight(self) -> bool:
        return bool(self.state.inflight)

    def pop_deltas(self) -> TokenDeltas | None:
        """Deltas not produced by a step (admission errors, aborts), if any are queued."""
        return self.state.deltas.take(OUT_OF_BAND_STEP, None)

    # ------------------------------------------------------------------ steps

    def may_plan(self, plans_in_flight: int) -> bool:
        """Whether the loop may plan another step while `plans_in_flight` are out
        (scheduler_proc.plans_in_flight has the rule)."""
        return self.depth.may_plan(plans_in_flight, self.state)

    def schedule(self) -> StepPlan | None:
        """Plan the next step, or None when there is nothing to compute."""
        start = time.perf_counter()
        in_flight = len(self.state.inflight)
        plan = plan_step(self.state)
        if plan is not None:
            self.depth.planned(plan, in_flight, self.state.stats)
        self.state.stats.schedule_time_s += time.perf_counter() - start
        return plan

    def process_result(self, result: StepResult) -> TokenDeltas:
        """Append the tokens of the oldest plan in flight, apply stop conditions, free the
        finished, and return the deltas for the detokenizer (with any queued out-of-band)."""
        start = time.perf_counter()
        self.depth.result(result, start)
        deltas = apply_result(self.state, result)
        self.state.stats.result_time_s += time.perf_counter() - start
        self.state.stats.gpu_busy_s += result.gpu_busy_s
        return deltas

    def stats(self) -> EngineStats:
        """The counters and gauges now; safe to call from another thread (state.snapshot)."""
        return snapshot(self.state)

    def check_integrity(self) -> None:
        """Raise AssertionError if any scheduler or block-pool invariant is broken."""
        check_integrity(self.state)
