"""Paged KV block pool with refcounts and a chained-hash prefix cache."""

from __future__ import annotations

import operator
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import xxhash

from scheduler_proc.sequence import Sequence

_NO_HASH = -1


def hash_block(parent_hash: int, token_ids: Seq[int]) -> int:
    """Chained hash of one full block: covers the parent's hash and the token ids themselves,
    so equal hashes mean equal prefixes (up to a 64-bit collision, which token comparison and
    the stored parent hash rule out in practice)."""
    data = parent_hash.to_bytes(8, "little") + array("q", token_ids).tobytes()
    return xxhash.xxh3_64_intdigest(data)


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    """Leading full blocks of a token sequence found in the prefix cache (no refs taken yet)."""

    block_ids: tuple[int, ...]
    last_hash: int

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


NO_PREFIX = CachedPrefix((), 0)


@dataclass(frozen=True, slots=True)
class Allocation:
    """What one allocate() call added to a sequence's block table."""

    new_block_ids: list[int]
    num_cached_tokens: int


class BlockManager:
    """Fixed pool of KV blocks.

    A block is either held (refcount > 0, listed in the block tables of exactly that many
    sequences) or free. Free blocks keep their hash and stay findable in the prefix cache;
    they are handed out least-recently-freed first, so a cached prefix survives until its
    block is actually needed. A block is hashed only once all its tokens are known and their
    KV is written by plans already sent (see hash_full_blocks).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes = [_NO_HASH] * num_blocks
        # (parent hash, token ids) of each hashed block, to confirm a hash hit.
        self.block_keys: list[tuple[int, tuple[int, ...]] | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        # Insertion order == order freed; popitem(last=False) takes the least recently freed.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.on_evict: Callable[[int, int, tuple[int, tuple[int, ...]]], None] | None = None
        """Told (block, hash, key) of each cached block evicted, before it is reused (the
        host tier stores it)."""

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, token_ids: list[int]) -> CachedPrefix:
        """Longest run of cached full blocks at the start of token_ids.

        It never covers the last token: that token's logits are needed to sample, so at least
        one token is always left to compute (a fully cached prompt would leave zero queries).
        """
        if not self.enable_prefix_caching:
            return NO_PREFIX
        bs = self.block_size
        parent = 0
        found: list[int] = []
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = hash_block(parent, tokens)
            block = self.hash_to_block.get(h)
            if block is None or self.block_keys[block] != (parent, tokens):
                break
            found.append(block)
            parent = h
        return CachedPrefix(tuple(found), parent) if found else NO_PREFIX

    def allocate(
        self, seq: Sequence, num_tokens: int, prefix: CachedPrefix = NO_PREFIX
    ) -> Allocation | None:
        """Grow seq's block table to hold num_tokens tokens, starting with `prefix` when given
        (only for an empty table). Returns None, changing nothing, when the pool is short."""
        table = seq.block_table
        hits = prefix.block_ids
        num_new = -(-num_tokens // self.block_size) - len(table) - len(hits)
        if hits:
            assert not table, "a prefix hit starts an empty block table"
            ref_counts = self.ref_counts
            free_hits = sum(1 for b in hits if ref_counts[b] == 0)
            if num_new + free_hits > len(self.free_blocks):
                return None
            for b in hits:
                if ref_counts[b] == 0:
                    del self.free_blocks[b]
                ref_counts[b] += 1
                table.append(b)
            seq.num_hashed_blocks = len(hits)
            seq.last_hash = prefix.last_hash
        elif num_new > len(self.free_blocks):  # growing a table (a decode step's new block)
            return None
        new_ids = [self._take_free_block() for _ in range(num_new)]
        table.extend(new_ids)
        return Allocation(new_ids, len(hits) * self.block_size)

    def _take_free_block(self) -> int:
        block, _ = self.free_blocks.popitem(last=False)
        h = self.block_hashes[block]
        if h != _NO_HASH:  # evict: its cached prefix is gone from here on
            if self.on_evict is not None:
                self.on_evict(block, h, self.block_keys[block])
            del self.hash_to_block[h]
            self.block_hashes[block] = _NO_HASH
            self.block_keys[block] = None
        self.ref_counts[block] = 1
        return block

    def free(self, seq: Sequence) -> None:
        """Release all of seq's blocks at once. The tail is freed first so it is evicted before
        the (more widely shared) head of the prefix."""
        ref_counts = self.ref_counts
        for b in reversed(seq.block_table):
            ref_counts[b] -= 1
            if ref_counts[b] == 0:
                self.free_blocks[b] = None
        seq.block_table = []
        seq.num_hashed_blocks = 0
        seq.last_hash = 0

    def free_tail(self, seq: Sequence, num_tokens: int) -> None:
        """Release the blocks of seq's table past those num_tokens tokens need (blocks that
        were reserved for rejected speculative tokens; never hashed, as no known token of
        the sequence is in them)."""
        keep = max(self.blocks_for(num_tokens), seq.num_hashed_blocks)
        table = seq.block_table
        for b in table[keep:]:
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_blocks[b] = None
        del table[keep:]

    def hash_full_blocks(self, seq: Sequence) -> None:
        """Enter seq's newly completed blocks in the prefix cache.

        A block qualifies when it is full of *known* tokens whose KV is written by plans
        already sent. Under overlap the scheduler plans past tokens it has not seen yet, and a
        finished sequence's last token is never computed, hence min(computed, known). Workers
        run plans in order, so a later plan that hits such a block reads finished KV.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        upto = min(seq.num_computed, len(seq.token_ids)) // bs
        i = seq.num_hashed_blocks
        if i >= upto:
            return
        parent = seq.last_hash
        token_ids = seq.token_ids
        table = seq.block_table
        while i < upto:
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = hash_block(parent, tokens)
            block = table[i]
            # A duplicate of an already indexed block (same prefix computed twice at once)
            # stays unindexed; the chain continues either way.
            if self.block_hashes[block] == _NO_HASH and h not in self.hash_to_block:
                self.hash_to_block[h] = block
                self.block_hashes[block] = h
                self.block_keys[block] = (parent, tokens)
            parent = h
            i += 1
        seq.num_hashed_blocks = i
        seq.last_hash = parent

    def check_integrity(self, block_tables: Iterable[list[int]]) -> None:
        """Raise AssertionError unless: every block is free xor held, refcount == number of
        block tables holding it, free + held == total, and the hash index is consistent.

        The scheduler runs this whenever it goes idle, and a small model's pool on a large GPU
        has millions of blocks: Python loops go over the held blocks only, and each pass over
        the whole pool or index runs in C (list.count, map)."""
        n, refs, free = self.num_blocks, self.ref_counts, self.free_blocks
        holders: dict[int, int] = {}
        for table in block_tables:
            for b in table:
                holders[b] = holders.get(b, 0) + 1
        problems = []
        held = n - refs.count(0)
        if held != len(holders) or any(refs[b] != k for b, k in holders.items()):
            bad = [b for b in range(n) if holders.get(b, 0) != refs[b]]
            problems.append(f"refcount != holders for blocks {bad[:10]}")
        # The free blocks are the others: none of them held, and as many as are left.
        if any(b in free for b in holders) or held + len(free) != n:
            problems.append(f"free {len(free)} + held {held} != {n}")
        index, hashes, keys = self.hash_to_block, self.block_hashes, self.block_keys
        if (not all(map(operator.eq, map(hashes.__getitem__, index.values()), index))
                or None in map(keys.__getitem__, index.values())):
            problems += [f"index maps hash {h:#x} to block {b} which has another hash"
                         for h, b in index.items() if hashes[b] != h or keys[b] is None]
        indexed = n - hashes.count(_NO_HASH)
        if indexed != len(index):
            problems.append(f"{indexed} hashed blocks but {len(index)} index entries")
        if problems:
            raise AssertionError("; ".join(problems))
