"""Planning one step: which tokens of which sequences it computes, within the token budget.

One token-count model, no prefill/decode phases: a running sequence is asked for its next
`num_new` tokens (1 when decoding, a chunk while prefilling), so one step mixes both. Running
sequences are served first, in admission order, preempting from the tail when blocks run out;
waiting ones are admitted with what budget is left. Between clients, who is admitted and who
is preempted follows the fair-share rule of scheduler_proc.fair_share.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field

from protocol import CachedSequences, NewSequence, StepPlan
from protocol.packed_ints import int32_array
from protocol.step_messages import NO_MOVES
from scheduler_proc.block_manager import BlockManager
from scheduler_proc.fair_share import HOLE, pressure_victim
from scheduler_proc.sequence import Sequence
from scheduler_proc.state import RUNNING, PlanInFlight, SchedulerState
from scheduler_proc.swap import plan_swap_in, swap_in

_NO_NEW_BLOCKS: list[int] = []
"""The new block ids of the many entries that get none: one shared list, never mutated."""


@dataclass(slots=True)
class _StepBatch:
    """What one plan accumulates: the token budget left and the plan's columns."""

    budget: int
    cached_ids: list[int] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    num_spec: list[int] = field(default_factory=list)  # filled only when speculating
    sampled_spec: list[int] = field(default_factory=list)  # num_spec of each of `sampled`
    new_blocks: list[list[int]] = field(default_factory=list)
    sampled: list[Sequence] = field(default_factory=list)  # running ones this step samples for
    new_seqs: list[NewSequence] = field(default_factory=list)
    new_sampled: list[Sequence] = field(default_factory=list)  # admitted ones it samples for
    preempted: bool = False


def plan_step(state: SchedulerState) -> StepPlan | None:
    """Plan the next step and record it as in flight, or None when there is nothing to compute.

    Overlap: this advances num_computed as it plans, and plans every decoding sequence as if
    it survives the step still in flight (its input is the token that step samples, which the
    workers already hold: Sequence.num_pending). With speculation the step in flight may also
    accept any number of its proposals up to Sequence.spec_inflight: the plan still says
    n = 1 (the workers compute from their own counts, which include the accepted ones), and
    blocks and length caps are sized for the case where every one is accepted."""
    bm = state.block_manager
    for seq in state.to_hash:
        if seq.status is RUNNING:
            bm.hash_full_blocks(seq)
    state.to_hash.clear()

    batch = _StepBatch(state.config.max_num_batched_tokens)
    if state.waiting:  # fair share: a client owed a slot takes it from the largest
        room = state.waiting.needs_room(state.running, state.config.max_num_seqs)
        if room is not None:
            state.preempt(state.running.pop(room))
    _continue_running(state, batch)
    if not batch.preempted:  # under memory pressure admitting more would only thrash
        _admit_waiting(state, batch)

    if not batch.cached_ids and not batch.new_seqs:
        return None
    step_id = state.next_step_id
    trims = state.trims
    plan = StepPlan(
        step_id,
        state.drops,
        batch.new_seqs,
        CachedSequences(batch.cached_ids, batch.num_new, batch.new_blocks, batch.num_spec),
        list(trims),
        list(trims.values()),
        NO_MOVES if state.kv_tier is None else state.kv_tier.take_moves(),
    )
    state.drops = []
    state.trims = {}
    # Workers apply new_seqs before cached entries; results come back in that order.
    spec = [0] * len(batch.new_sampled) + batch.sampled_spec if any(batch.sampled_spec) else []
    sampled_ids = (batch.cached_ids if len(batch.sampled) == len(batch.cached_ids)  # decoding
                   else [s.seq_id for s in batch.sampled])
    state.inflight.append(PlanInFlight(
        step_id, batch.new_sampled + batch.sampled,
        [s.seq_id for s in batch.new_sampled] + sampled_ids, spec))
    state.next_step_id = step_id + 1
    return plan


def _continue_running(state: SchedulerState, batch: _StepBatch) -> None:
    """Give each running sequence its next tokens while budget lasts, growing its block table;
    when the pool is full, preempt the most recently admitted until the growth fits."""
    bm = state.block_manager
    max_model_len = state.config.max_model_len
    bs = state.config.block_size
    running = state.running
    budget = batch.budget
    ids, add_sampled = batch.cached_ids, batch.sampled.append
    add_id = ids.append
    # Most entries are a decode step: one token, no new block. Only the others are noted, as
    # (row, num_new, new block ids), and the two columns are filled after the loop.
    others: list[tuple[int, int, list[int]]] = []
    to_hash = state.to_hash
    prefill = 0
    spec_k = state.config.num_speculative_tokens

    # Hot loop (one pass per running sequence per step): locals and bound methods only.
    # Preemption takes this sequence or one after it (the tail with one client), so the
    # entries already planned are never touched. This one, taken from the middle, leaves a
    # hole (popping it would skip the next entry), and the holes are closed after the loop.
    holes = False
    for seq in running:
        if budget <= 0:
            break
        pending = seq.num_pending
        target = len(seq.token_ids) + pending
        ahead = seq.spec_inflight  # proposals in flight: accepted or not, unknown yet
        # Overlap hazard: a token still in flight that may end the sequence (max_tokens or
        # max_model_len reached, were every proposal in flight accepted) is not fed back; that
        # could only compute a token to discard, past the length the sequence was admitted
        # for. Without speculation (ahead == 0) such a token is certain to end it; with it,
        # the sequence waits one step for the result that tells.
        # A prefill replica's sequence whose first token is in flight goes no further here: it
        # is handed off to its decode replica when that token arrives (scheduler_proc.handoff).
        if pending and (target + ahead >= seq.max_len or seq.decode_replica >= 0):
            continue
        computed = seq.num_computed
        n = target - computed
        if n > budget:
            n = budget
        k = _spec_tokens(seq, spec_k, n, target, budget, max_model_len, bm) if spec_k else 0
        # The workers compute from their own count, which is up to `ahead` further on.
        reach = computed + ahead + n + k
        blocks = _NO_NEW_BLOCKS
        if reach > len(seq.block_table) * bs:
            alloc = bm.allocate(seq, reach)
            while alloc is None:
                # The most recently admitted (of the client holding the most).
                i = pressure_victim(state.waiting, running, seq)
                victim = running[i]
                if victim is seq and i < len(running) - 1:
                    running[i] = HOLE
                    holes = True
                else:
                    del running[i]
                state.preempt(victim)
                batch.preempted = True
                if victim is seq:
                    break
                alloc = bm.allocate(seq, reach)
            if alloc is None:  # this one went: plan the rest
                continue
            blocks = alloc.new_block_ids
        if n != 1 or blocks:
            others.append((len(ids), n, blocks))
            if n > 1:
                to_hash.append(seq)
        add_id(seq.seq_id)
        if spec_k:
            batch.num_spec.append(k)
            seq.spec_inflight = ahead + k
        budget -= n + k
        if computed < seq.num_prefill:  # a later chunk of a prefill (never past its end)
            prefill += n
        seq.num_computed = computed + n
        if computed + n == target:
            seq.num_pending = pending + 1
            add_sampled(seq)
            if spec_k:
                batch.sampled_spec.append(k)
    if holes:
        running[:] = [s for s in running if s is not HOLE]
    batch.num_new = [1] * len(ids)
    batch.new_blocks = [_NO_NEW_BLOCKS] * len(ids)
    for row, n, blocks in others:
        batch.num_new[row] = n
        batch.new_blocks[row] = blocks
    batch.budget = budget
    state.stats.prompt_tokens += prefill


def _spec_tokens(seq: Sequence, spec_k: int, n: int, target: int, budget: int,
                 max_model_len: int, bm: BlockManager) -> int:
    """Proposals a decoding entry may verify this step: within the token budget, the blocks
    free now (speculation never preempts), and so that even if all are accepted the sequence
    cannot pass max_tokens or max_model_len (the bonus token counts: hence the - 1). The
    proposals of plans in flight count as accepted (the worst case)."""
    computed = seq.num_computed
    if n != 1 or computed + 1 != target:  # prefill chunks do not speculate
        return 0
    ahead = seq.spec_inflight
    longest = target + ahead
    room = (len(seq.block_table) + bm.num_free) * bm.block_size - computed - ahead - 1
    k = min(spec_k, budget - 1, room, max_model_len - longest - 1,
            seq.max_tokens - (longest - seq.num_prompt_tokens) - 1)
    return k if k > 0 else 0


def _known_tokens(seq: Sequence) -> array:
    """Every token of a sequence sent in full, packed: its prompt as it arrived (no copy), and
    after a preemption what it generated before (ids rank 0 sampled from the vocabulary)."""
    if len(seq.token_ids) == seq.num_prompt_tokens:
        return seq.prompt_ids
    return seq.prompt_ids + int32_array(seq.token_ids[seq.num_prompt_tokens:])


def _admit_waiting(state: SchedulerState, batch: _StepBatch) -> None:
    """Move waiting sequences to running, each with its first chunk, while budget,
    max_num_seqs and free blocks allow. Each is sent to the workers in full."""
    bm = state.block_manager
    bs = state.config.block_size
    max_seqs = state.config.max_num_seqs
    waiting, running = state.waiting, state.running
    budget = batch.budget
    stats = state.stats
    tier = state.kv_tier
    now = time.monotonic()
    if state.handoffs is not None and state.handoffs.landed:
        budget = _admit_landed(state, batch, budget)
    while waiting and budget > 0 and len(running) < max_seqs:
        client = waiting.next_client()
        seq = client.waiting[0]
        # Overlap hazard: a sequence preempted while its last sampled token is in flight
        # cannot be re-sent in full until that token arrives.
        if seq.num_pending:
            break
        # A resumed sequence looks its whole known text up: the hit covers whole blocks
        # and never the last token, and it starts from an empty block table, so it cannot
        # index past it.
        prefix = bm.find_cached_prefix(seq.token_ids)
        num_device = prefix.num_blocks * bs
        resume = None if tier is None else plan_swap_in(tier, seq, prefix)
        if resume is not None:  # swapped out: all its computed KV waits on the host
            host_slots = []
            num_cached = resume.num_computed
        else:
            host_slots = tier.match(seq.token_ids, prefix) if tier and bm.enable_prefix_caching \
                else []
            num_cached = num_device + len(host_slots) * bs
        n = min(len(seq.token_ids) - num_cached, budget)
        alloc = bm.allocate(seq, num_cached + n, prefix)
        if alloc is None:
            break
        if resume is not None:
            swap_in(tier, seq, resume, alloc.new_block_ids)
        elif host_slots:  # the first new blocks take the host tier's KV before the forward
            tier.load(host_slots, alloc.new_block_ids[:len(host_slots)])
        waiting.pop(client)
        client.running += 1
        seq.status = RUNNING
        running.append(seq)
        batch.new_seqs.append(
            NewSequence(
                seq.seq_id,
                _known_tokens(seq),
                seq.num_prompt_tokens,
                num_cached,
                n,
                int32_array(seq.block_table),  # a copy: the table grows after this plan
                seq.params,
            )
        )
        seq.on_worker = True
        seq.num_computed = num_cached + n
        seq.num_prefill = len(seq.token_ids)
        stats.prompt_tokens += n
        # Swapped-in KV is neither computed nor a prefix hit: the swap counters count it.
        stats.cached_prompt_tokens += num_device if resume is not None else num_cached
        if seq.first_scheduled_s is None:
            seq.first_scheduled_s = now
            seq.num_cached_prompt = min(num_cached, seq.num_prompt_tokens)
            seq.num_host_prompt = seq.num_cached_prompt - min(num_device, seq.num_cached_prompt)
        budget -= n
        if seq.num_computed == len(seq.token_ids):
            seq.num_pending += 1
            batch.new_sampled.append(seq)
        state.to_hash.append(seq)
    batch.budget = budget


def _admit_landed(state: SchedulerState, batch: _StepBatch, budget: int) -> int:
    """A decode replica runs sequences whose KV landed from a prefill replica before any
    waiting one: the blocks already hold their prompt's KV (counted as computed, neither
    computed nor cached here), and the first step computes the first token's and samples."""
    landed, running, bm = state.handoffs.landed, state.running, state.block_manager
    while landed and budget > 0 and len(running) < state.config.max_num_seqs:
        seq = landed[0]
        computed = seq.num_computed
        n = min(len(seq.token_ids) - computed, budget)
        if bm.allocate(seq, computed + n) is None:
            break
        landed.popleft()
        state.handoffs.admitted(seq)
        seq.status = RUNNING
        running.append(seq)
        batch.new_seqs.append(NewSequence(
            seq.seq_id, _known_tokens(seq), seq.num_prompt_tokens, computed, n,
            int32_array(seq.block_table), seq.params))
        seq.on_worker = True
        seq.num_computed = computed + n
        seq.num_prefill = len(seq.token_ids)
        budget -= n
        if seq.num_computed == len(seq.token_ids):
            seq.num_pending += 1
            batch.new_sampled.append(seq)
        state.to_hash.append(seq)
    return budget
