"""Host-tier copies: batched gather/scatter over every layer, store then load round-trips."""

import pytest
import torch

from gpu_workers.block_mover import (
    BlockMover,
    gather_blocks,
    make_host_pool,
    scatter_blocks,
    slot_runs,
)
from protocol import codec
from protocol.step_messages import BlockMoves, CachedSequences, StepPlan


def pool(num_blocks, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, num_blocks, 4, 2, 8, generator=g)


def test_store_then_load_brings_back_every_layer_of_each_block():
    device = pool(6)
    original = device.clone()
    mover = BlockMover(device, make_host_pool(device, 4))
    mover.store([5, 1, 3], [2, 0, 3])
    assert torch.equal(mover.host_pool[2], original[:, :, 5])
    assert torch.equal(mover.host_pool[0], original[:, :, 1])
    device.zero_()
    mover.load([0, 3, 2], [4, 0, 2])
    mover.wait_loads()
    assert torch.equal(device[:, :, 4], original[:, :, 1])
    assert torch.equal(device[:, :, 0], original[:, :, 3])
    assert torch.equal(device[:, :, 2], original[:, :, 5])
    untouched = [1, 3, 5]
    assert not device[:, :, untouched].any()
    assert mover.bytes_stored == mover.bytes_loaded == 3 * 2 * 3 * 4 * 2 * 8 * 4


def test_each_run_of_consecutive_slots_is_one_copy():
    assert slot_runs([4, 5, 6, 0, 1, 9]) == [(0, 4, 3), (3, 0, 2), (5, 9, 1)]
    assert slot_runs([3, 2]) == [(0, 3, 1), (1, 2, 1)]
    assert slot_runs([]) == []


def test_a_host_block_is_one_contiguous_stretch_of_memory():
    host = make_host_pool(pool(6), 5)
    assert host.shape == (5, 2, 3, 4, 2, 8)
    assert host[1:4].is_contiguous()


def test_gather_scatter_move_blocks_between_two_pools_of_the_same_layout():
    a, b = pool(5, seed=1), torch.zeros(2, 3, 7, 4, 2, 8)
    scatter_blocks(b, [6, 0], gather_blocks(a, [2, 3]))
    assert torch.equal(b[:, :, 6], a[:, :, 2]) and torch.equal(b[:, :, 0], a[:, :, 3])


def test_a_plan_carries_its_moves_over_the_wire():
    moves = BlockMoves([3, 4], [0, 1], [7], [9])
    plan = StepPlan(5, [], [], CachedSequences([], [], []), moves=moves)
    decoded = codec.Decoder(StepPlan).decode(codec.encode(plan))
    assert decoded.moves == moves and bool(decoded.moves)
    empty = StepPlan(6, [], [], CachedSequences([], [], []))
    plain = codec.Decoder(StepPlan).decode(codec.encode(empty))
    assert not plain.moves


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_moves_are_ordered_after_the_writes_before_them_and_before_the_reads_after():
    device = torch.zeros(2, 4, 64, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    mover = BlockMover(device, make_host_pool(device, 32))
    # Work queued on the compute stream writes the blocks; the store must see it.
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(8):
        big = big @ big / 64
    device[:, :, 10:20] = 3.0
    mover.store(list(range(10, 20)), list(range(20, 30)))
    assert mover.host_pool[20:30].is_pinned()  # its slice, pinned for the copy
    device[:, :, 10:20] = 5.0  # the block is handed out again: the store read it before this
    mover.synchronize()
    assert torch.all(mover.host_pool[20:30] == 3.0)
    # A load is waited for by the compute stream before what reads the blocks.
    device[:, :, 40:50] = 0.0
    mover.apply(BlockMoves([], [], list(range(20, 30)), list(range(40, 50))))
    seen = device[:, :, 40:50].float().sum()  # queued on the compute stream after wait_loads
    assert seen.item() == 3.0 * device[:, :, 40:50].numel()
