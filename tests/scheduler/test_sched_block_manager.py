"""BlockManager: exact block ids, LRU eviction of cached blocks, prefix hits, integrity."""

from __future__ import annotations

import pytest

from protocol import SamplingParams
from scheduler_proc import BlockManager, Sequence


def seq(seq_id: int, tokens: list[int], computed: int | None = None) -> Sequence:
    s = Sequence(seq_id, tokens, SamplingParams())
    s.num_computed = len(tokens) if computed is None else computed
    return s


def run(bm: BlockManager, s: Sequence) -> None:
    """Allocate with any prefix hit, as the scheduler does on admission, then hash."""
    prefix = bm.find_cached_prefix(s.token_ids)
    assert bm.allocate(s, len(s.token_ids), prefix) is not None
    bm.hash_full_blocks(s)


def test_allocate_exact_block_ids_and_free_order():
    bm = BlockManager(8, 4)
    a = seq(1, list(range(10)))
    alloc = bm.allocate(a, 10)
    assert alloc.new_block_ids == [0, 1, 2] and alloc.num_cached_tokens == 0
    assert a.block_table == [0, 1, 2]
    grow = bm.allocate(a, 13)
    assert grow.new_block_ids == [3]
    assert bm.allocate(a, 16).new_block_ids == []
    bm.free(a)
    # The tail is freed first, so it is reused first.
    assert list(bm.free_blocks) == [4, 5, 6, 7, 3, 2, 1, 0]
    bm.check_integrity([])


def test_allocate_refuses_without_side_effects():
    bm = BlockManager(2, 4)
    a = seq(1, list(range(9)))
    assert bm.allocate(a, 9) is None
    assert a.block_table == [] and bm.num_free == 2
    bm.check_integrity([])


def test_prefix_hit_shares_blocks_and_refcounts():
    bm = BlockManager(8, 4)
    a = seq(1, list(range(10)))
    run(bm, a)
    b = seq(2, list(range(9)) + [99])
    prefix = bm.find_cached_prefix(b.token_ids)
    assert prefix.block_ids == (0, 1)
    alloc = bm.allocate(b, 10, prefix)
    assert alloc.num_cached_tokens == 8 and alloc.new_block_ids == [3]
    assert b.block_table == [0, 1, 3]
    assert bm.ref_counts[:4] == [2, 2, 1, 1]
    bm.check_integrity([a.block_table, b.block_table])


def test_hit_never_covers_last_token_and_stops_at_whole_blocks():
    bm = BlockManager(8, 4)
    run(bm, seq(1, list(range(12))))
    # Exactly three cached blocks: the last block must still be computed.
    assert bm.find_cached_prefix(list(range(12))).block_ids == (0, 1)
    assert bm.find_cached_prefix(list(range(13))).block_ids == (0, 1, 2)
    # A partial block never hits.
    assert bm.find_cached_prefix(list(range(7))).block_ids == (0,)
    assert bm.find_cached_prefix(list(range(4))).block_ids == ()
    assert bm.find_cached_prefix([5, 1, 2, 3, 4]).block_ids == ()


def test_freed_blocks_stay_cached_until_reused_lru():
    bm = BlockManager(4, 2)
    a = seq(1, [1, 2, 3, 4, 5])  # blocks 0,1 full and hashed; block 2 partial
    run(bm, a)
    bm.free(a)
    assert list(bm.free_blocks) == [3, 2, 1, 0]
    assert bm.find_cached_prefix([1, 2, 3, 4, 9]).block_ids == (0, 1)
    # Taking two blocks evicts 3 and 2 (least recently freed), the cached ones survive.
    b = seq(2, [7, 7, 7, 7])
    assert bm.allocate(b, 3).new_block_ids == [3, 2]
    assert bm.find_cached_prefix([1, 2, 3, 4, 9]).block_ids == (0, 1)
    # The next block taken is 1: the second cached block is evicted, the chain stops at 0.
    assert bm.allocate(b, 5).new_block_ids == [1]
    assert bm.find_cached_prefix([1, 2, 3, 4, 9]).block_ids == (0,)
    bm.check_integrity([b.block_table])


def test_hit_on_free_cached_block_counts_against_free_pool():
    bm = BlockManager(3, 2)
    a = seq(1, [1, 2, 3, 4])
    run(bm, a)
    bm.free(a)
    b = seq(2, [1, 2, 3, 4, 5, 6, 7])
    prefix = bm.find_cached_prefix(b.token_ids)
    assert prefix.block_ids == (0, 1)
    # Needs the two cached blocks plus two new ones: only three exist.
    assert bm.allocate(b, 7, prefix) is None
    assert bm.allocate(b, 6, prefix).new_block_ids == [2]
    bm.check_integrity([b.block_table])


def test_only_computed_known_tokens_are_hashed():
    bm = BlockManager(8, 4)
    a = seq(1, list(range(8)), computed=5)
    bm.allocate(a, 8)
    bm.hash_full_blocks(a)
    assert a.num_hashed_blocks == 1 and len(bm.hash_to_block) == 1
    # Under overlap, computed can run ahead of the known tokens.
    a.num_computed = 9
    bm.allocate(a, 9)
    bm.hash_full_blocks(a)
    assert a.num_hashed_blocks == 2


def test_duplicate_content_is_indexed_once():
    bm = BlockManager(8, 4)
    a, b = seq(1, list(range(8))), seq(2, list(range(8)))
    for s in (a, b):
        bm.allocate(s, 8)
    for s in (a, b):
        bm.hash_full_blocks(s)
    assert len(bm.hash_to_block) == 2
    assert bm.find_cached_prefix(list(range(9))).block_ids == (0, 1)
    bm.check_integrity([a.block_table, b.block_table])


def test_hash_hit_is_confirmed_by_tokens():
    bm = BlockManager(8, 4)
    run(bm, seq(1, list(range(9))))
    # Pretend another prefix collided with block 0's hash: its tokens disagree, so no hit.
    h = bm.block_hashes[0]
    bm.block_keys[0] = (0, (9, 9, 9, 9))
    assert bm.hash_to_block[h] == 0
    assert bm.find_cached_prefix(list(range(9))).block_ids == ()


def test_prefix_caching_disabled():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    run(bm, seq(1, list(range(9))))
    assert bm.hash_to_block == {}
    assert bm.find_cached_prefix(list(range(9))).block_ids == ()


def test_check_integrity_detects_corruption():
    bm = BlockManager(4, 2)
    a = seq(1, [1, 2, 3])
    bm.allocate(a, 3)
    bm.check_integrity([a.block_table])
    with pytest.raises(AssertionError, match="refcount"):
        bm.check_integrity([])
    bm.ref_counts[0] += 1
    with pytest.raises(AssertionError):
        bm.check_integrity([a.block_table])
    bm.ref_counts[0] -= 1
    bm.hash_to_block[123] = 3
    with pytest.raises(AssertionError, match="index"):
        bm.check_integrity([a.block_table])
    del bm.hash_to_block[123]
    bm.check_integrity([a.block_table])
    held = a.block_table[0]
    bm.free_blocks[held] = None  # held and free at once
    with pytest.raises(AssertionError, match="free"):
        bm.check_integrity([a.block_table])
    del bm.free_blocks[held]
    lost = next(iter(bm.free_blocks))
    del bm.free_blocks[lost]  # neither free nor held
    with pytest.raises(AssertionError, match="free"):
        bm.check_integrity([a.block_table])
