"""What moves between the device pool and the host tier in the step being planned.

Stores: a hashed block leaving the device prefix cache (evicted by the block manager to be
handed out again) is copied to a host slot, unless the host already holds its hash. Loads: a
sequence being admitted continues its device prefix hit with the blocks the host holds; they
get fresh device blocks and count as computed, like a device hit. Both go into the plan's
BlockMoves; workers run stores before loads before the forward, so a device block may be
stored and reused by the same step. Within one step a host slot is written or read once: the
slots a step stores to or loads from are pinned, and the slots it gives back are released,
only once the plan is built (take_moves), so no store of the same step takes them.
Swaps (scheduler_proc.swap) use the same moves, keyed by sequence rather than by hash.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.step_messages import NO_MOVES, BlockMoves
from scheduler_proc.block_manager import BlockManager, CachedPrefix
from scheduler_proc.host_pool import BlockKey, HostPool


@dataclass(slots=True)
class TierCounters:
    """Totals since start-up, for the engine's stats."""

    hit_tokens: int = 0
    blocks_stored: int = 0
    blocks_loaded: int = 0
    swaps_out: int = 0
    """Preempted sequences whose KV went to the host tier (the others are recomputed)."""
    swaps_in: int = 0
    """Swapped sequences resumed with their KV loaded back."""


@dataclass(frozen=True, slots=True)
class SwappedKV:
    """Where a swapped-out sequence's KV waits (scheduler_proc.swap): host_slots[i] holds its
    block i."""

    host_slots: list[int]
    num_tokens: int
    """Tokens whose KV the slots hold (the sequence's computed count when it was swapped)."""


@dataclass(slots=True)
class _PlanMoves:
    store_device: list[int] = field(default_factory=list)
    store_host: list[int] = field(default_factory=list)
    load_host: list[int] = field(default_factory=list)
    load_device: list[int] = field(default_factory=list)


class KVTier:
    """The scheduler's side of the host tier: hooks the block manager's evictions."""

    def __init__(self, block_manager: BlockManager, num_slots: int) -> None:
        self.block_manager = block_manager
        self.host = HostPool(num_slots)
        self.counters = TierCounters()
        self._moves = _PlanMoves()
        self._pinned: list[int] = []
        self._released: list[int] = []
        self.swapped: dict[int, SwappedKV] = {}
        """Swapped-out sequences by id: the host slots that hold all their KV."""
        block_manager.on_evict = self._store

    def _store(self, device_block: int, block_hash: int, key: BlockKey) -> None:
        st = self.host.store(block_hash, key, device_block)
        if st is not None:
            self.store_blocks([st.device_block], [st.host_slot])

    def store_blocks(self, device_blocks: list[int], slots: list[int]) -> None:
        """Plan device blocks' KV into host slots (pinned until the plan is built)."""
        self._moves.store_device.extend(device_blocks)
        self._moves.store_host.extend(slots)
        self.host.pin(slots)
        self._pinned.extend(slots)
        self.counters.blocks_stored += len(slots)

    def load_blocks(self, slots: list[int], device_blocks: list[int]) -> None:
        """Plan host slots' KV into device blocks, before the forward that reads them."""
        self._moves.load_host.extend(slots)
        self._moves.load_device.extend(device_blocks)
        self.counters.blocks_loaded += len(slots)

    def release_after_step(self, slots: list[int]) -> None:
        """Give slots back once the plan is built: a load of this step may still read them."""
        self._released.extend(slots)

    def match(self, token_ids: list[int], prefix: CachedPrefix) -> list[int]:
        """Host slots continuing a device prefix hit; pinned until take_moves."""
        parent = prefix.last_hash if prefix.num_blocks else 0
        slots, _ = self.host.match(token_ids, self.block_manager.block_size,
                                   prefix.num_blocks, parent)
        self.host.pin(slots)
        self._pinned.extend(slots)
        return slots

    def load(self, slots: list[int], device_blocks: list[int]) -> None:
        """Plan slots' KV into device blocks (the first blocks past the device hit)."""
        self.load_blocks(slots, device_blocks)
        self.counters.hit_tokens += len(slots) * self.block_manager.block_size

    def take_moves(self) -> BlockMoves:
        """The planned step's moves; unpins and releases what this step stores or loads."""
        m = self._moves
        self.host.unpin(self._pinned)
        self._pinned = []
        for slot in self._released:
            self.host.release(slot)
        self._released = []
        if not (m.store_device or m.load_host):
            return NO_MOVES
        self._moves = _PlanMoves()
        return BlockMoves(m.store_device, m.store_host, m.load_host, m.load_device)
