"""The host KV tier's pool pinned a slice at a time (gpu_workers.host_pinning).

On the CPU the registration is a recorder standing in for CUDA's: what is registered (whole
slots, every byte once, in slices no larger than asked), what is undone when a registration
fails, and that the memory outlives every view of it and is unregistered before it goes. On
CUDA (gpu marker): the pool is pinned and copies in and out of it across slices round-trip.
"""

from __future__ import annotations

import gc

import pytest
import torch

from gpu_workers.block_mover import BlockMover, slot_runs
from gpu_workers.host_pinning import HostRegistrationError, pinned_slots, slice_slots


class Recorder:
    def __init__(self, fail_at: int | None = None) -> None:
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.fail_at = fail_at

    def register(self, address: int, nbytes: int) -> None:
        if len(self.registered) == self.fail_at:
            raise HostRegistrationError("refused")
        self.registered.append((address, nbytes))

    def unregister(self, address: int) -> None:
        self.unregistered.append(address)


SHAPE = [10, 2, 3, 4, 8]  # 10 slots of 192 bf16 values: 384 bytes each
SLOT_BYTES = 384


def test_slices_are_whole_slots_covering_the_pool_once():
    rec = Recorder()
    pool = pinned_slots(SHAPE, torch.bfloat16, slice_bytes=1000, register=rec.register,
                        unregister=rec.unregister)
    assert pool.shape == tuple(SHAPE) and pool.dtype == torch.bfloat16
    assert pool.is_contiguous()
    starts = [a for a, _ in rec.registered]
    sizes = [n for _, n in rec.registered]
    assert sizes == [2 * SLOT_BYTES] * 5  # 1000 bytes hold two whole slots
    assert starts[0] == pool.data_ptr()
    assert all(b - a == 2 * SLOT_BYTES for a, b in zip(starts, starts[1:]))


def test_a_slot_larger_than_a_slice_is_a_slice_of_its_own():
    assert slice_slots(5000, 1000) == 1
    assert slice_slots(300, 1000) == 3
    rec = Recorder()
    pinned_slots([3, 1000], torch.uint8, slice_bytes=2500, register=rec.register,
                 unregister=rec.unregister)
    assert [n for _, n in rec.registered] == [2000, 1000]


def test_the_memory_lives_as_long_as_a_view_and_is_unregistered_before_it_goes():
    rec = Recorder()
    pool = pinned_slots(SHAPE, torch.float32, slice_bytes=2 * 768, register=rec.register,
                        unregister=rec.unregister)
    pool.copy_(torch.arange(pool.numel(), dtype=torch.float32).view(SHAPE))
    view = pool[7:9]
    del pool
    gc.collect()
    assert rec.unregistered == []
    assert torch.equal(view.flatten()[:3], torch.tensor([7 * 192, 7 * 192 + 1, 7 * 192 + 2],
                                                        dtype=torch.float32))
    del view
    gc.collect()
    assert sorted(rec.unregistered) == sorted(a for a, _ in rec.registered)


def test_a_refused_registration_undoes_the_others_and_raises():
    rec = Recorder(fail_at=3)
    with pytest.raises(HostRegistrationError):
        pinned_slots(SHAPE, torch.bfloat16, slice_bytes=SLOT_BYTES, register=rec.register,
                     unregister=rec.unregister)
    gc.collect()
    assert len(rec.registered) == 3
    assert sorted(rec.unregistered) == sorted(a for a, _ in rec.registered)


def test_an_fp8_pool_views_its_bytes():
    rec = Recorder()
    pool = pinned_slots([4, 16], torch.float8_e4m3fn, slice_bytes=32, register=rec.register,
                        unregister=rec.unregister)
    assert pool.dtype == torch.float8_e4m3fn and pool.shape == (4, 16)
    assert [n for _, n in rec.registered] == [32, 32]


def test_runs_end_at_a_slice_edge():
    assert slot_runs([4, 5, 6, 7, 8], bound=6) == [(0, 4, 2), (2, 6, 3)]
    assert slot_runs([0, 1, 2, 3], bound=2) == [(0, 0, 2), (2, 2, 2)]
    assert slot_runs([5, 6, 7], bound=None) == [(0, 5, 3)]
    assert slot_runs([3, 2, 1], bound=2) == [(0, 3, 1), (1, 2, 1), (2, 1, 1)]


@pytest.mark.gpu
def test_a_pool_pinned_in_slices_round_trips_blocks_across_them():
    device = torch.randn(2, 3, 12, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
    original = device.clone()
    host = pinned_slots([9, 2, 3, 16, 2, 64], torch.bfloat16,
                        slice_bytes=2 * 2 * 3 * 16 * 2 * 64 * 2)  # two blocks a slice
    assert host.is_pinned()
    mover = BlockMover(device, host, slice_slots=2)
    mover.store([0, 1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7])  # every run crosses a slice
    device.zero_()
    mover.load([1, 2, 3, 4, 5, 6, 7], [11, 10, 9, 8, 7, 6, 5])
    mover.wait_loads()
    mover.synchronize()
    torch.cuda.synchronize()
    for block, back in zip(range(7), [11, 10, 9, 8, 7, 6, 5]):
        assert torch.equal(device[:, :, back], original[:, :, block])
