"""The host KV tier's pool, begun once the rank is ready, made on a thread (CUDA) or at once
(CPU): the mover comes from the same pool either way; a pool that cannot be pinned is kept in
pageable memory. tests/runtime/test_gpu_peak_memory.py checks the pinned pool on CUDA."""

from __future__ import annotations

import threading

import pytest
import torch

from gpu_workers import host_tier_start
from gpu_workers.block_mover import HostPoolTooSmall, HostTierUnsupported
from gpu_workers.host_tier_start import HostTierStart, pinning_settings

# [2, layers, blocks, block_size, kv_heads, head_dim]
STORAGE_SHAPE = (2, 3, 10, 4, 2, 8)
BLOCK_BYTES = 2 * 3 * 4 * 2 * 8 * 4


def _storage() -> torch.Tensor:
    return torch.zeros(STORAGE_SHAPE, dtype=torch.float32)


@pytest.mark.parametrize("background", [False, True])
def test_the_mover_holds_the_slots_the_size_buys(background):
    start = HostTierStart(_storage(), 5 * BLOCK_BYTES / 2**30, 1, None, background=background)
    assert start.slots == 5
    mover = start.mover()
    assert mover is not None and mover.host_pool.shape == (5, 2, 3, 4, 2, 8)
    assert mover.block_bytes == BLOCK_BYTES
    assert start.mover() is not mover  # a second call makes another mover over the same pool


def test_nothing_is_allocated_before_begin_and_then_beside_the_caller(monkeypatch):
    release, began = threading.Event(), threading.Event()
    real = host_tier_start.make_host_pool

    def slow_pool(storage, slots, pin=None):
        began.set()
        assert release.wait(10)
        return real(storage, slots, pin)

    monkeypatch.setattr(host_tier_start, "make_host_pool", slow_pool)
    start = HostTierStart(_storage(), 3 * BLOCK_BYTES / 2**30, 1, None, background=True)
    assert start.slots == 3 and start.block_bytes == BLOCK_BYTES
    assert not began.wait(0.2)  # the rank gets ready first: the pool waits for begin()
    start.begin()
    assert began.wait(10)  # the caller goes on while it allocates
    release.set()
    assert start.mover().host_pool.shape[0] == 3


def test_a_pool_that_cannot_be_pinned_is_kept_in_pageable_memory(monkeypatch, caplog):
    real, asked = host_tier_start.make_host_pool, []

    def pinning_fails(storage, slots, pin=None):
        asked.append(pin)
        if pin is not False:
            raise RuntimeError("CUDA error: out of memory (pinned)")
        return real(storage, slots, pin)

    monkeypatch.setattr(host_tier_start, "make_host_pool", pinning_fails)
    start = HostTierStart(_storage(), 3 * BLOCK_BYTES / 2**30, 1, None, background=True)
    start.begin()
    with caplog.at_level("WARNING", logger="nanopipe.worker"):
        mover = start.mover()
    assert asked == [None, False] and mover.host_pool.shape[0] == 3
    assert not mover.host_pool.is_pinned()
    assert "pinning 3 slots failed" in caplog.text and "out of memory" in caplog.text
    # Made once: a later mover works on the same slots.
    mover.host_pool[1].fill_(7.0)
    assert float(start.mover().host_pool[1].sum()) == 7.0 * mover.host_pool[1].numel()


def test_a_pool_made_at_once_fails_where_it_is_begun(monkeypatch):
    def no_memory(storage, slots, pin=None):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(host_tier_start, "make_host_pool", no_memory)
    start = HostTierStart(_storage(), 3 * BLOCK_BYTES / 2**30, 1, None, background=False)
    with pytest.raises(RuntimeError, match="out of memory"):
        start.begin()


def test_off_too_small_and_draft_are_settled_at_once():
    off = HostTierStart(_storage(), 0.0, 1, None, background=True)
    assert off.slots == 0 and off.mover() is None
    with pytest.raises(HostPoolTooSmall):
        HostTierStart(_storage(), BLOCK_BYTES / 2 / 2**30, 1, None)
    with pytest.raises(HostTierUnsupported, match="draft"):
        HostTierStart(_storage(), 3 * BLOCK_BYTES / 2**30, 1, object())


def test_pinning_by_registering_keeps_the_users_settings():
    ours = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"
    assert pinning_settings({}, cpus=16) == ours
    assert pinning_settings({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
                            cpus=64) == f"expandable_segments:True,{ours}"
    assert pinning_settings({"PYTORCH_ALLOC_CONF": "max_split_size_mb:512"}, cpus=16) == \
        f"max_split_size_mb:512,{ours}"
    assert pinning_settings({"PYTORCH_CUDA_ALLOC_CONF": "pinned_use_cuda_host_register:False"},
                            cpus=16) is None
    # Threads: a power of two, at most half the CPUs, at least one.
    assert [pinning_settings({}, cpus=n).rsplit(":", 1)[1] for n in (1, 2, 6, 12, 200)] == \
        ["1", "1", "2", "4", "8"]


PINNED_BY_REGISTERING = """
import torch
from gpu_workers.host_tier_start import pin_by_registering
pin_by_registering()
host = torch.arange(16 << 20, dtype=torch.int32).pin_memory()  # 64 MiB
assert host.is_pinned()
device = host.to("cuda", non_blocking=True)
back = torch.empty_like(host, pin_memory=True)
back.copy_(device, non_blocking=True)
torch.cuda.synchronize()
assert torch.equal(back, host)
del host, back
empty = getattr(torch._C, "_host_emptyCache", None)
if empty is not None:
    empty()  # the blocks are freed the way they were pinned
print("ok")
"""


@pytest.mark.gpu
def test_a_worker_pins_by_registering_and_copies_as_before():
    """In a process of its own, as a worker: the setting is process-wide."""
    import subprocess
    import sys
    from pathlib import Path

    out = subprocess.run([sys.executable, "-c", PINNED_BY_REGISTERING], capture_output=True,
                         text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0 and out.stdout.split() == ["ok"], out.stderr[-2000:]
