"""The host tier's index: LRU by chained hash, confirmed keys, pins, swap slots, sizing."""

import pytest

from gpu_workers.block_mover import HostPoolTooSmall, host_pool_slots
from scheduler_proc.block_manager import hash_block
from scheduler_proc.host_pool import HostPool, parse_offloading_size

BS = 4


def chain(token_ids, num_blocks):
    """(hash, key) of the first num_blocks full blocks of token_ids, chained."""
    out, parent = [], 0
    for i in range(num_blocks):
        tokens = tuple(token_ids[i * BS : (i + 1) * BS])
        h = hash_block(parent, tokens)
        out.append((h, (parent, tokens)))
        parent = h
    return out


def test_stored_prefix_is_matched_in_order_and_stops_before_the_last_token():
    pool = HostPool(8)
    prompt = list(range(100, 113))  # 3 full blocks + 1 token
    stores = [pool.store(h, key, device_block=10 + i)
              for i, (h, key) in enumerate(chain(prompt, 3))]
    assert [s.device_block for s in stores] == [10, 11, 12]
    slots, last = pool.match(prompt, BS, 0, 0)
    assert slots == [s.host_slot for s in stores]
    assert last == chain(prompt, 3)[-1][0]
    # A prompt of exactly 3 blocks leaves its last block to compute.
    assert pool.match(prompt[:12], BS, 0, 0)[0] == slots[:2]
    # Matching continues from a device prefix: start at block 1 with block 0's hash.
    assert pool.match(prompt, BS, 1, chain(prompt, 1)[0][0])[0] == slots[1:]
    # A different first block matches nothing (chained hashes).
    assert pool.match([0] + prompt[1:], BS, 0, 0) == ([], 0)


def test_store_of_a_held_hash_is_skipped_and_lru_evicts_the_oldest():
    pool = HostPool(2)
    a, b, c = (chain([n] * BS + [0], 1)[0] for n in (1, 2, 3))
    sa = pool.store(*a, device_block=0)
    assert pool.store(*a, device_block=5) is None  # already on the host
    pool.store(*b, device_block=1)
    pool.match([1] * BS + [0], BS, 0, 0)  # touch a: b is now the oldest
    sc = pool.store(*c, device_block=2)
    assert a[0] in pool and c[0] in pool and b[0] not in pool
    assert sc.host_slot != sa.host_slot and pool.num_evicted == 1 and pool.num_used == 2


def test_pinned_slots_survive_eviction_and_a_fully_pinned_pool_refuses_stores():
    pool = HostPool(1)
    a, b = (chain([n] * BS + [0], 1)[0] for n in (1, 2))
    sa = pool.store(*a, device_block=0)
    pool.pin([sa.host_slot])
    assert pool.store(*b, device_block=1) is None and a[0] in pool
    assert pool.take_anonymous(1) is None and a[0] in pool
    pool.unpin([sa.host_slot])
    assert pool.store(*b, device_block=1) is not None and a[0] not in pool


def test_swap_slots_are_taken_by_count_and_released():
    pool = HostPool(3)
    a = chain([7] * BS + [0], 1)[0]
    pool.store(*a, device_block=0)
    slots = pool.take_anonymous(3)  # evicts the cached block to make room
    assert sorted(slots) == [0, 1, 2] and a[0] not in pool and pool.num_used == 3
    assert pool.take_anonymous(1) is None
    for s in slots:
        pool.release(s)
    assert pool.num_used == 0


def test_sizing_and_parsing_errors_are_one_line():
    assert host_pool_slots(0, 4096) == 0
    assert host_pool_slots(10 * 4096 + 1, 4096) == 10
    with pytest.raises(HostPoolTooSmall, match="cannot hold one KV block") as err:
        host_pool_slots(100, 4096)
    assert "\n" not in str(err.value)
    assert parse_offloading_size("1.5") == 1.5
    for bad in ("lots", "-1", "nan", "inf", None):
        with pytest.raises(ValueError, match="kv_offloading_size must be") as err:
            parse_offloading_size(bad)
        assert "\n" not in str(err.value)
