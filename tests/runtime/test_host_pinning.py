"""The host KV tier's pool, page-locked a slice at a time (gpu_workers.host_pinning).

On the CPU the registration is a recorder standing in for CUDA's: nothing is registered
until asked; idle pinning goes lowest slice first, whole slots, every byte once; a copy's
slices are pinned on demand and idle pinning then skips them; a refused slice leaves the
rest pageable; the memory outlives every view of it and is unregistered before it goes. On
CUDA (gpu marker): a mover pins the slices its copies use, and blocks round-trip across them.
"""

from __future__ import annotations

import gc

import pytest
import torch

from gpu_workers.block_mover import BlockMover, slot_runs
from gpu_workers.host_pinning import HostRegistrationError, PinnedPool, slice_slots


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


def _pool(rec: Recorder, shape=SHAPE, dtype=torch.bfloat16, slice_bytes=1000) -> PinnedPool:
    return PinnedPool(shape, dtype, slice_bytes=slice_bytes, register=rec.register,
                      unregister=rec.unregister)


def test_idle_pinning_goes_lowest_first_in_whole_slots_covering_the_pool_once():
    rec = Recorder()
    pins = _pool(rec)
    pool = pins.tensor
    assert pool.shape == tuple(SHAPE) and pool.dtype == torch.bfloat16 and pool.is_contiguous()
    assert rec.registered == [] and not pins.done  # nothing until asked
    while pins.pin_idle():
        pass
    assert pins.done and not pins.pin_idle()
    starts = [a for a, _ in rec.registered]
    assert [n for _, n in rec.registered] == [2 * SLOT_BYTES] * 5  # two whole slots a slice
    assert starts[0] == pool.data_ptr()
    assert all(b - a == 2 * SLOT_BYTES for a, b in zip(starts, starts[1:]))


def test_a_copy_pins_its_slices_and_idle_pinning_skips_them():
    rec = Recorder()
    pins = _pool(rec)
    base = pins.tensor.data_ptr()
    pins.ensure([7, 6, 9])  # slices 3 and 4
    pins.ensure([6])  # pinned already: nothing more
    assert rec.registered == [(base + 6 * SLOT_BYTES, 2 * SLOT_BYTES),
                              (base + 8 * SLOT_BYTES, 2 * SLOT_BYTES)]
    assert pins.pinned_slices == 2 and not pins.done
    while pins.pin_idle():
        pass
    assert sorted(a for a, _ in rec.registered) == [base + i * 2 * SLOT_BYTES for i in range(5)]


def test_a_slot_larger_than_a_slice_is_a_slice_of_its_own():
    assert slice_slots(5000, 1000) == 1
    assert slice_slots(300, 1000) == 3
    rec = Recorder()
    pins = _pool(rec, [3, 1000], torch.uint8, slice_bytes=2500)
    while pins.pin_idle():
        pass
    assert [n for _, n in rec.registered] == [2000, 1000]


def test_the_memory_lives_as_long_as_a_view_and_is_unregistered_before_it_goes():
    rec = Recorder()
    pins = _pool(rec, dtype=torch.float32, slice_bytes=2 * 768)
    pins.ensure([0, 8])
    pool = pins.tensor
    pool.copy_(torch.arange(pool.numel(), dtype=torch.float32).view(SHAPE))
    view = pool[7:9]
    del pool, pins
    gc.collect()
    assert rec.unregistered == []
    assert torch.equal(view.flatten()[:3], torch.tensor([7 * 192, 7 * 192 + 1, 7 * 192 + 2],
                                                        dtype=torch.float32))
    del view
    gc.collect()
    assert sorted(rec.unregistered) == sorted(a for a, _ in rec.registered)
    assert len(rec.unregistered) == 2


def test_a_refused_slice_leaves_the_rest_pageable(caplog):
    rec = Recorder(fail_at=3)
    pins = _pool(rec, slice_bytes=SLOT_BYTES)
    with caplog.at_level("WARNING", logger="nanopipe.worker"):
        while pins.pin_idle():
            pass
    assert len(rec.registered) == 3 and pins.done and isinstance(pins.error,
                                                                 HostRegistrationError)
    assert "refused after 3 of 10 slices" in caplog.text and "pageable" in caplog.text
    pins.ensure([9])  # no further attempt: the pool stays usable as it is
    assert len(rec.registered) == 3
    pins.tensor[9].fill_(1.5)
    assert float(pins.tensor[9].float().mean()) == 1.5
    del pins
    gc.collect()
    assert sorted(rec.unregistered) == sorted(a for a, _ in rec.registered)


def test_an_fp8_pool_views_its_bytes():
    rec = Recorder()
    pins = _pool(rec, [4, 16], torch.float8_e4m3fn, slice_bytes=32)
    while pins.pin_idle():
        pass
    assert pins.tensor.dtype == torch.float8_e4m3fn and pins.tensor.shape == (4, 16)
    assert [n for _, n in rec.registered] == [32, 32]


def test_runs_end_at_a_slice_edge():
    assert slot_runs([4, 5, 6, 7, 8], bound=6) == [(0, 4, 2), (2, 6, 3)]
    assert slot_runs([0, 1, 2, 3], bound=2) == [(0, 0, 2), (2, 2, 2)]
    assert slot_runs([5, 6, 7], bound=None) == [(0, 5, 3)]
    assert slot_runs([3, 2, 1], bound=2) == [(0, 3, 1), (1, 2, 1), (2, 1, 1)]


@pytest.mark.gpu
def test_a_mover_pins_the_slices_it_copies_through_and_blocks_round_trip():
    device = torch.randn(2, 3, 12, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
    original = device.clone()
    pins = PinnedPool([9, 2, 3, 16, 2, 64], torch.bfloat16,
                      slice_bytes=2 * 2 * 3 * 16 * 2 * 64 * 2)  # two blocks a slice
    assert pins.pinned_slices == 0
    mover = BlockMover(device, pins)
    mover.store([0, 1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7])  # every run crosses a slice
    assert pins.pinned_slices == 4 and pins.tensor[1:8].is_pinned()
    device.zero_()
    mover.load([1, 2, 3, 4, 5, 6, 7], [11, 10, 9, 8, 7, 6, 5])
    mover.wait_loads()
    mover.synchronize()
    torch.cuda.synchronize()
    for block, back in zip(range(7), [11, 10, 9, 8, 7, 6, 5]):
        assert torch.equal(device[:, :, back], original[:, :, block])
    while pins.pin_idle():
        pass
    assert pins.done and pins.pinned_slices == 5 and pins.tensor.is_pinned()
