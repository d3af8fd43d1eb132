"""Which prompt blocks each replica was given: the router's picture of the replicas' prefix
caches.

The router hashes a request's full prompt blocks with the scheduler's chain (xxh3 over the
parent's hash and the block's token ids, so a hash names the whole prefix up to its block)
and remembers, per replica, the hashes it sent there, least recently used first, at most as
many as that replica has KV blocks. It is kept here rather than published by the schedulers
because the router knows at the moment of placing, without waiting for a publication (a burst
of requests sharing a prefix all follow the first), costs the schedulers nothing, and needs
no change to them. What it cannot see is an eviction inside a replica; bounding each summary
by that replica's pool, in LRU order like the pool's own, keeps the picture close.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence

import xxhash

HASH_BYTES = 8
"""What one remembered block costs on the wire or in a compact array (a 64-bit hash)."""


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained hash of each full block of `token_ids` (the scheduler's chain)."""
    hashes = []
    parent = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        data = parent.to_bytes(8, "little") + array(
            "q", token_ids[start:start + block_size]).tobytes()
        parent = xxhash.xxh3_64_intdigest(data)
        hashes.append(parent)
    return hashes


class PrefixSummary:
    """The block hashes one replica was given, bounded, least recently used first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"PrefixSummary capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def matched_blocks(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt this replica was given before."""
        n = 0
        for h in hashes:
            if h not in self._hashes:
                break
            n += 1
        return n

    def add(self, hashes: Sequence[int]) -> None:
        """Remember a placed prompt's blocks as the most recently used."""
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def clear(self) -> None:
        self._hashes.clear()

    @property
    def compact_bytes(self) -> int:
        """Its size as a plain array of hashes: what publishing or storing it would cost."""
        return len(self._hashes) * HASH_BYTES
