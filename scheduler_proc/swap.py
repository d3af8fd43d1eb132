"""Preemption by swap: a preempted sequence's KV goes to the host tier and comes back.

The rule (swap_pays): a preempted sequence is swapped when the host tier is on, it has more
than `swap_min_tokens` computed tokens (default: one block; a shorter one is recomputed in
one cheap chunk), no speculative proposals of it are in flight (their count of accepted
tokens is not known yet), and the host pool has room for all its blocks now, taking free
slots and evicting cached prefix blocks but never another swapped sequence's. Otherwise it
is recomputed, as without a tier.

A swapped sequence's blocks are keyed by the sequence, not by hash: it needs all its KV, the
partial last block included. Ordering: the stores go into the plan being built, which every
rank runs after the plans that wrote those blocks and before any write of the plans that
reuse them (stores run first in a step). On resume the blocks the device prefix cache still
holds are shared as a hit; the rest get fresh device blocks and are loaded before the
forward that reads them, and every slot is given back once that plan is built.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_proc.block_manager import CachedPrefix
from scheduler_proc.config import SchedulerConfig
from scheduler_proc.kv_tier import KVTier, SwappedKV
from scheduler_proc.sequence import Sequence


@dataclass(frozen=True, slots=True)
class SwapIn:
    """How a swapped sequence resumes: its computed count, and the slots to load into the
    first new blocks past its device prefix hit."""

    num_computed: int
    load_slots: list[int]


def swap_pays(seq: Sequence, tier: KVTier, config: SchedulerConfig) -> bool:
    """The documented rule (module docstring): swap rather than recompute."""
    min_tokens = config.block_size if config.swap_min_tokens is None else config.swap_min_tokens
    if seq.spec_inflight or seq.num_computed <= min_tokens:
        return False
    return tier.host.room() >= tier.block_manager.blocks_for(seq.num_computed)


def swap_out(tier: KVTier, seq: Sequence) -> None:
    """Plan the copy of every block holding seq's computed KV to host slots; call before its
    blocks are freed."""
    num_blocks = tier.block_manager.blocks_for(seq.num_computed)
    slots = tier.host.take_anonymous(num_blocks)
    assert slots is not None, "swap_out without swap_pays"
    tier.store_blocks(seq.block_table[:num_blocks], slots)
    tier.swapped[seq.seq_id] = SwappedKV(slots, seq.num_computed)
    tier.counters.swaps_out += 1


def plan_swap_in(tier: KVTier, seq: Sequence, prefix: CachedPrefix) -> SwapIn | None:
    """What resuming seq takes from its swap (None: it is not swapped). A device prefix hit
    that reaches as far as the swap makes the loads unnecessary."""
    swapped = tier.swapped.get(seq.seq_id)
    if swapped is None:
        return None
    hit = prefix.num_blocks * tier.block_manager.block_size
    if hit >= swapped.num_tokens or swapped.num_tokens >= len(seq.token_ids):
        return SwapIn(hit, [])
    return SwapIn(swapped.num_tokens, swapped.host_slots[prefix.num_blocks:])


def swap_in(tier: KVTier, seq: Sequence, plan: SwapIn, new_block_ids: list[int]) -> None:
    """Plan the loads of an admitted swapped sequence and give all its slots back."""
    if plan.load_slots:
        tier.load_blocks(plan.load_slots, new_block_ids[:len(plan.load_slots)])
        tier.counters.swaps_in += 1
    discard(tier, seq.seq_id)


def discard(tier: KVTier, seq_id: int) -> None:
    """Forget a sequence's swap (resumed, finished or aborted) once this plan is built."""
    swapped = tier.swapped.pop(seq_id, None)
    if swapped is not None:
        tier.release_after_step(swapped.host_slots)
