"""The scheduler's index of the host KV tier: which host slot holds which prefix block.

Workers keep the bytes (each rank its own shard, same layout as its device pool); the
scheduler alone decides what goes where, so this index is the only copy of the mapping. A
slot is keyed by the same chained xxhash the device prefix cache uses (block_manager.
hash_block) and confirmed by the (parent hash, token ids) key, as on the device. Slots are
evicted least recently used: a lookup or a store makes a block the most recent.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from scheduler_proc.block_manager import hash_block

BlockKey = tuple[int, tuple[int, ...]]
"""(parent hash, token ids) of one full block."""


def parse_offloading_size(text: str | float | int) -> float:
    """The --kv-offloading-size value in GiB, or a one-line ValueError."""
    try:
        gib = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"kv_offloading_size must be a number of GiB, got {text!r}") from None
    if not gib >= 0 or gib == float("inf"):
        raise ValueError(f"kv_offloading_size must be a finite number of GiB >= 0, got {text!r}")
    return gib


@dataclass(frozen=True, slots=True)
class HostStore:
    """One block the scheduler asks workers to copy device -> host."""

    device_block: int
    host_slot: int


class HostPool:
    """LRU index of host slots by chained block hash."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._by_hash: OrderedDict[int, int] = OrderedDict()  # hash -> slot, LRU first
        self._keys: dict[int, BlockKey] = {}  # hash -> key that confirms it
        self._slot_hash: list[int | None] = [None] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._pinned: dict[int, int] = {}  # slot -> loads in flight that read it
        self.num_evicted = 0

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._by_hash

    def store(self, block_hash: int, key: BlockKey, device_block: int) -> HostStore | None:
        """Reserve a slot for a block leaving the device; None when it is already held or
        every slot is pinned by a load in flight. Evicts the least recently used slot."""
        if self.num_slots == 0:
            return None
        if block_hash in self._by_hash:
            self._by_hash.move_to_end(block_hash)
            return None
        if self._free:
            slot = self._free.pop()
        else:
            slot = self._evict_one()
            if slot is None:
                return None
        self._by_hash[block_hash] = slot
        self._keys[block_hash] = key
        self._slot_hash[slot] = block_hash
        return HostStore(device_block, slot)

    def _evict_one(self) -> int | None:
        for h, slot in self._by_hash.items():
            if slot not in self._pinned:
                del self._by_hash[h]
                del self._keys[h]
                self._slot_hash[slot] = None
                self.num_evicted += 1
                return slot
        return None

    def match(self, token_ids: Seq[int], block_size: int, start_block: int,
              parent_hash: int) -> tuple[list[int], int]:
        """Host slots of the blocks that continue a prefix at start_block (whose parent hash
        is parent_hash), and the last hash matched. Like the device cache it never covers the
        last token, which must be computed to sample."""
        slots: list[int] = []
        parent = parent_hash
        for i in range(start_block, (len(token_ids) - 1) // block_size):
            tokens = tuple(token_ids[i * block_size : (i + 1) * block_size])
            h = hash_block(parent, tokens)
            slot = self._by_hash.get(h)
            if slot is None or self._keys[h] != (parent, tokens):
                break
            self._by_hash.move_to_end(h)
            slots.append(slot)
            parent = h
        return slots, parent

    def pin(self, slots: Seq[int]) -> None:
        """Keep slots from eviction until unpin: a load planned from them is in flight."""
        for s in slots:
            self._pinned[s] = self._pinned.get(s, 0) + 1

    def unpin(self, slots: Seq[int]) -> None:
        for s in slots:
            n = self._pinned[s] - 1
            if n:
                self._pinned[s] = n
            else:
                del self._pinned[s]

    def release(self, slot: int) -> None:
        """Give a slot back (a swapped-out sequence's block once it is swapped in)."""
        h = self._slot_hash[slot]
        if h is not None:
            del self._by_hash[h]
            del self._keys[h]
            self._slot_hash[slot] = None
        self._free.append(slot)

    def room(self) -> int:
        """Slots a swap-out could take now: free ones and cached blocks not pinned (a swapped
        sequence's slots are never evicted: they are its only copy of its KV)."""
        pinned = self._pinned
        return len(self._free) + sum(1 for s in self._by_hash.values() if s not in pinned)

    def take_anonymous(self, count: int) -> list[int] | None:
        """Slots for a swap-out: blocks of a running sequence, not all of them hashed, so they
        are not findable by hash. None when count cannot be had (then nothing is evicted)."""
        if count > self.room():
            return None
        while len(self._free) < count:
            slot = self._evict_one()
            assert slot is not None, "room() counted an unpinned cached slot"
            self._free.append(slot)
        return [self._free.pop() for _ in range(count)]
