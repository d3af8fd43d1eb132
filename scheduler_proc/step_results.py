"""Applying a step's result: append the sampled tokens, apply stop conditions, free the
finished, and build the deltas for the detokenizer.

Results arrive in plan order. With overlap, the next plan is already sent when a result is
applied, so a sequence may have finished, been aborted or been preempted since it was planned;
each such case is marked "Overlap hazard" where it is handled.
"""

from __future__ import annotations

import time

from protocol import ErrorKind, FinishReason, RequestError, StepResult, TokenDeltas
from scheduler_proc.sequence import Sequence
from scheduler_proc.state import FINISHED, RUNNING, PlanInFlight, SchedulerState
from scheduler_proc.token_deltas_columns import NO_LOGPROBS

STOP, LENGTH, ERROR = FinishReason.STOP, FinishReason.LENGTH, FinishReason.ERROR


def apply_result(state: SchedulerState, result: StepResult) -> TokenDeltas:
    """Apply the result of the oldest plan in flight; return its deltas, together with any
    queued out-of-band ones."""
    inflight = state.inflight
    if not inflight or inflight[0].step_id != result.step_id:
        expected = inflight[0].step_id if inflight else None
        raise ValueError(f"result for step {result.step_id}, expected step {expected}")
    plan = inflight.popleft()
    seqs = plan.seqs
    # Whatever the result says, these proposals are no longer in flight; the accepted ones
    # are counted below as computed tokens.
    for seq, k in zip(seqs, plan.num_spec):
        seq.spec_inflight -= k
    if result.failed_seq_ids:
        _fail_refused(state, result)
    if result.ended_seq_ids:
        _end_with_error(state, result)
    seqs = _match(plan, result)
    if result.num_tokens is not None:
        return _apply_speculative(state, result, seqs)
    tokens = result.token_ids
    # Hot loop (one pass per decoding sequence per step): locals only; the deltas' columns
    # are filled after it, in bulk, from the result's own columns.
    skipped: list[int] = []  # entries whose sequence finished before this result
    finishes: list[tuple[int, FinishReason]] = []  # (delta row, reason)
    bs = state.config.block_size
    bm = state.block_manager
    finished_running = False
    now = time.monotonic()  # every token of one result arrived together
    for k, seq in enumerate(seqs):
        seq.num_pending -= 1
        # Overlap hazard: this seq finished (or was aborted) after this plan was sent; the
        # token it produced is an extra one to discard. Its blocks were already freed,
        # which is safe: they can only be reused by plans sent after this one.
        if seq.status is FINISHED:
            skipped.append(k)
            continue
        tok = tokens[k]
        token_ids = seq.token_ids
        token_ids.append(tok)
        length = len(token_ids)
        seq.last_token_s = now
        if seq.first_token_s is None:
            seq.first_token_s = now
        if tok in seq.stop_tokens:
            finishes.append((k - len(skipped), STOP))
            finished_running |= _finish(state, seq, STOP)
        elif length >= seq.max_len:
            finishes.append((k - len(skipped), LENGTH))
            finished_running |= _finish(state, seq, LENGTH)
        else:
            # A block just filled with known tokens whose KV is written: into the prefix cache.
            full = (seq.num_hashed_blocks + 1) * bs
            if length >= full and seq.num_computed >= full and seq.status is RUNNING:
                bm.hash_full_blocks(seq)
    if state.handoffs is not None and state.handoffs.role == "prefill":
        for seq in seqs:  # a first token that did not end its request: on to decode
            if seq.status is RUNNING and seq.decode_replica >= 0:
                state.handoffs.hand_off(seq)
                state.deltas.handoff_ids.append(seq.seq_id)
                finished_running = True
    if finished_running:
        state.running = [s for s in state.running if s.status is RUNNING]
    state.stats.generated_tokens += state.deltas.add_sampled(result, skipped, finishes)
    return state.deltas.take(result.step_id, result.logprobs is not None)


def _apply_speculative(state: SchedulerState, result: StepResult,
                       seqs: list[Sequence]) -> TokenDeltas:
    """apply_result for a step that verified proposals: entry k produced num_tokens[k] tokens
    (flat in token_ids). They are appended one by one through the stop conditions; tokens past
    a stop, max_tokens or max_model_len are dropped, never streamed. The accepted proposals'
    KV is written, so they count as computed; blocks reserved for rejected ones are freed
    where no plan in flight can still write them, and the next plan tells the workers to cut
    their tables the same way (SchedulerState.trim)."""
    deltas, stats, bm = state.deltas, state.stats, state.block_manager
    tokens, logprobs = result.token_ids, result.logprobs
    top_ids, top_lps = result.top_token_ids, result.top_logprobs
    if top_ids is not None:
        deltas.pad_top()
    proposed = result.num_proposed or [0] * len(seqs)
    now = time.monotonic()  # every token of one result arrived together
    finished_running = False
    start = 0
    for seq, count, num_proposed in zip(seqs, result.num_tokens, proposed, strict=True):
        first, start = start, start + count
        seq.num_pending -= 1
        if seq.status is FINISHED:  # aborted while the step ran
            continue
        stats.spec_proposed_tokens += num_proposed
        stats.spec_accepted_tokens += count - 1
        seq.spec_proposed += num_proposed
        seq.spec_accepted += count - 1
        token_ids = seq.token_ids
        reason = None
        end = first
        while end < start and reason is None:
            tok = tokens[end]
            token_ids.append(tok)
            end += 1
            length = len(token_ids)
            if tok in seq.stop_tokens:
                reason = STOP
            elif length >= seq.max_len:
                reason = LENGTH
        stats.generated_tokens += end - first
        if end > first:
            seq.last_token_s = now
            if seq.first_token_s is None:
                seq.first_token_s = now
        deltas.ids.append(seq.seq_id)
        deltas.tokens.append(tokens[first:end])
        deltas.reasons.append(reason)
        deltas.errors.append(None)
        deltas.logprobs.append(NO_LOGPROBS if logprobs is None else logprobs[first:end])
        if top_ids is not None:
            deltas.top_ids.append(top_ids[first:end])
            deltas.top_lps.append(top_lps[first:end])
        if reason is not None:
            finished_running |= _finish(state, seq, reason)
        elif seq.status is RUNNING:
            seq.num_computed += count - 1
            state.trim(seq)
            bm.hash_full_blocks(seq)
    if finished_running:
        state.running = [s for s in state.running if s.status is RUNNING]
    return deltas.take(result.step_id, logprobs is not None)


def _finish(state: SchedulerState, seq: Sequence, reason: FinishReason) -> bool:
    """Finish `seq` with `reason`; True if it was running (the caller then rebuilds the
    running list once). A sequence preempted while its token was in flight finishes waiting."""
    was_running = seq.status is RUNNING
    if not was_running:
        state.waiting.remove(seq)
    state.finish(seq, reason)
    return was_running


def _fail_refused(state: SchedulerState, result: StepResult) -> None:
    """Finish the requests whose sequences the workers refused, with their error.

    Finishing frees their blocks and lists them in the next plan's drops, which is what
    tells the workers to forget them. Until then (overlap) plans may still continue them;
    workers leave them out, and _match accepts their absence."""
    for sid, error in zip(result.failed_seq_ids, result.failed_errors, strict=True):
        seq = state.seqs.get(sid)
        if seq is None:  # aborted or finished meanwhile
            continue
        state.unlink(seq)
        state.finish(seq, ERROR)
        state.deltas.add(sid, [], ERROR, RequestError(
            ErrorKind.REQUEST_FAILED, f"the engine could not run this request: {error}"))


def _end_with_error(state: SchedulerState, result: StepResult) -> None:
    """End the requests the workers say cannot go on (StepResult.ended_seq_ids) with their
    error. Finished before the step's tokens are applied, their tokens are not kept."""
    for sid, error in zip(result.ended_seq_ids, result.ended_errors, strict=True):
        seq = state.seqs.get(sid)
        if seq is None or seq.status is FINISHED:  # aborted or finished meanwhile
            continue
        state.unlink(seq)
        state.finish(seq, ERROR)
        state.deltas.add(sid, [], ERROR, RequestError(
            ErrorKind.INVALID_REQUEST, error, "params.structured_outputs"))


def _match(plan: PlanInFlight, result: StepResult) -> list[Sequence]:
    """The planned sequences in the order of the result (normally identical).

    A planned sequence may be missing only if the workers refused it (it is finished by
    then); its token in flight is accounted for here."""
    ids = result.seq_ids
    counts = result.num_tokens
    if counts is not None and (len(counts) != len(ids) or sum(counts) != len(result.token_ids)
                               or min(counts, default=1) < 1):
        raise ValueError(f"step {result.step_id}: token counts do not match its tokens")
    if counts is None and len(result.token_ids) != len(ids):
        raise ValueError(f"step {result.step_id}: {len(ids)} sequences, "
                         f"{len(result.token_ids)} tokens")
    seqs = plan.seqs
    if ids == plan.seq_ids:
        return seqs
    by_id = {s.seq_id: s for s in seqs}
    try:
        matched = [by_id.pop(i) for i in ids]
    except KeyError as exc:
        raise ValueError(f"step {result.step_id}: unexpected sequence {exc}") from None
    for seq in by_id.values():
        if seq.status is not FINISHED:
            raise ValueError(f"step {result.step_id}: result has {len(ids)} sampled "
                             f"entries, plan expected {len(seqs)}")
        seq.num_pending -= 1
    return matched
