"""What moves between the device pool and the host tier in the step being planned.

Stores: a hashed block leaving the device prefix cache (evicted by the block manager to be
handed out again) is copied to a host slot, unless the host already holds its hash. Loads: a
sequence being admitted continues its device prefix hit with the blocks the host holds; they
get fresh device blocks and count as computed, like a device hit. Both go into the plan's
BlockMoves; workers run stores before loads before the forward, so a device block may be
stored and reused by the same step, and a store never takes a slot a load of the same step
reads (those slots are pinned until the plan is built).
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
        block_manager.on_evict = self._store

    def _store(self, device_block: int, block_hash: int, key: BlockKey) -> None:
        st = self.host.store(block_hash, key, device_block)
        if st is not None:
            self._moves.store_device.append(st.device_block)
            self._moves.store_host.append(st.host_slot)
            self.counters.blocks_stored += 1

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
        self._moves.load_host.extend(slots)
        self._moves.load_device.extend(device_blocks)
        self.counters.blocks_loaded += len(slots)
        self.counters.hit_tokens += len(slots) * self.block_manager.block_size

    def take_moves(self) -> BlockMoves:
        """The planned step's moves; unpins what this step loads from."""
        m = self._moves
        self.host.unpin(self._pinned)
        self._pinned = []
        if not (m.store_device or m.load_host):
            return NO_MOVES
        self._moves = _PlanMoves()
        return BlockMoves(m.store_device, m.store_host, m.load_host, m.load_device)
