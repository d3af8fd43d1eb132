"""One rank's host KV tier (gpu_workers.host_tier): the slots its size buys, a mover over its
pool at once, and, when the pool is page-locked, the slices left for the worker's idle time
(registration stood in for on the CPU; tests/runtime/test_host_pinning.py has the slices,
tests/runtime/test_worker_serve.py the loop that pins them)."""

from __future__ import annotations

import pytest
import torch

from gpu_workers import host_pinning
from gpu_workers.block_mover import HostPoolTooSmall, HostTierUnsupported
from gpu_workers.host_tier import HostTier, pinning_settings

# [2, layers, blocks, block_size, kv_heads, head_dim]
STORAGE_SHAPE = (2, 3, 10, 4, 2, 8)
BLOCK_BYTES = 2 * 3 * 4 * 2 * 8 * 4


def _storage() -> torch.Tensor:
    return torch.zeros(STORAGE_SHAPE, dtype=torch.float32)


def test_the_mover_holds_the_slots_the_size_buys():
    tier = HostTier(_storage(), 5 * BLOCK_BYTES / 2**30, 1, None)
    assert tier.slots == 5 and tier.block_bytes == BLOCK_BYTES
    mover = tier.mover
    assert mover is not None and mover.host_pool.shape == (5, 2, 3, 4, 2, 8)
    assert mover.block_bytes == BLOCK_BYTES
    assert not tier.pinning and not tier.pin_idle()  # on the CPU nothing is page-locked


def test_a_pinned_pool_is_usable_at_once_and_pinned_a_slice_per_idle_call(monkeypatch):
    registered: list[tuple[int, int]] = []
    monkeypatch.setattr(host_pinning, "cuda_register", lambda a, n: registered.append((a, n)))
    monkeypatch.setattr(host_pinning, "cuda_unregister", lambda a: None)
    storage = torch.arange(torch.Size(STORAGE_SHAPE).numel(), dtype=torch.float32)
    storage = storage.view(STORAGE_SHAPE)
    tier = HostTier(storage, 5 * BLOCK_BYTES / 2**30, 1, None, pin=True)
    assert tier.pinning and registered == []  # nothing pinned by making it
    tier.mover.store([3, 4], [0, 1])  # on the CPU a plain copy; the pins are CUDA's concern
    assert torch.equal(tier.mover.host_pool[0], storage[:, :, 3])
    assert torch.equal(tier.mover.host_pool[1], storage[:, :, 4])
    calls = 0
    while tier.pin_idle():
        calls += 1
    assert not tier.pinning and calls == 1  # 5 blocks of 192 bytes: one 16 MiB slice
    assert registered == [(tier.mover.host_pool.data_ptr(), 5 * BLOCK_BYTES)]


def test_off_too_small_and_draft_are_settled_at_once():
    off = HostTier(_storage(), 0.0, 1, None, pin=True)
    assert off.slots == 0 and off.mover is None and not off.pinning
    with pytest.raises(HostPoolTooSmall):
        HostTier(_storage(), BLOCK_BYTES / 2 / 2**30, 1, None)
    with pytest.raises(HostTierUnsupported, match="draft"):
        HostTier(_storage(), 3 * BLOCK_BYTES / 2**30, 1, object())


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
from gpu_workers.host_tier import pin_by_registering
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
