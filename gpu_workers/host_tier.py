"""One rank's host KV tier: its slot count, settled at start-up, and its pool and mover.

The slot count, which the ranks agree on with a collective, is settled while the rank
starts, so every rank's collectives stay in one order. Under CUDA the pool is page-locked a
slice at a time on the worker's thread (gpu_workers.host_pinning): while the worker idles
(`pin_idle`, called by its loop) and, for slices idle time has not reached, just before a
copy uses them. Nothing else waits for it: not the start-up, not a step that moves no block,
not a CUDA graph capture (there is no pinning thread whose calls a capture would forbid).

Other pinned buffers (the steps' staging) come from torch's pinned allocator. Unless the
user's allocator settings say how to pin, a worker process asks it to pin by registering
memory it has already mapped on several threads (`pinned_use_cuda_host_register`), rather
than with cudaHostAlloc, which faults in and zeroes every page on one thread while it holds
the driver's lock. It does so before its first pinned allocation (pin_by_registering): torch
frees a pinned block the way the setting says at the time, so the setting must not change
under a live block.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch

from gpu_workers.block_mover import BlockMover, HostTierUnsupported, host_pool_slots, make_host_pool
from gpu_workers.host_pinning import PinnedPool

log = logging.getLogger("nanopipe.worker")
ALLOC_SETTINGS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def pinning_settings(environ: Mapping[str, str] = os.environ,
                     cpus: int | None = None) -> str | None:
    """torch's allocator settings with registered pinning on up to 8 threads (a power of
    two, at most half the CPUs: the warm-up runs beside them), the user's own settings
    kept; None when those already say how to pin."""
    current = next((environ[k] for k in ALLOC_SETTINGS if environ.get(k)), "")
    if "pinned_" in current:
        return None
    threads = 1 << (max(1, min(8, (cpus or os.cpu_count() or 1) // 2)).bit_length() - 1)
    ours = f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{threads}"
    return f"{current},{ours}" if current else ours


def pin_by_registering() -> None:
    """Call before the process's first pinned allocation (see the module's docstring)."""
    settings = None if torch.version.hip else pinning_settings()
    if settings is None:
        return
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) \
        or torch.cuda.memory._set_allocator_settings
    try:
        setter(settings)
    except (AttributeError, RuntimeError) as exc:  # another torch: cudaHostAlloc it is
        log.debug("host KV tier: kept torch's pinning (%s)", exc)


class HostTier:
    """One rank's host tier: `slots` (0: off), the `mover` over its pool, and whether slices of
    the pool are left to pin (`pinning`, `pin_idle`)."""

    def __init__(self, storage: torch.Tensor, gib: float, world_size: int,
                 drafter: object | None, pin: bool | None = None) -> None:
        """`pin`: page-lock the pool (default: on CUDA)."""
        self.block_bytes = storage[:, :, 0].numel() * storage.element_size()
        slots = host_pool_slots(int(gib * 2**30), self.block_bytes)
        if world_size > 1:  # ranks may hold different KV heads: they agree on the least
            import torch.distributed as dist

            t = torch.tensor([slots], dtype=torch.int64, device=storage.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            slots = int(t.item())
        if slots and drafter is not None:
            raise HostTierUnsupported(
                "the host KV tier (kv_offloading_size) does not keep a draft model's KV; "
                "set kv_offloading_size=0 with speculative 'draft'")
        self.slots = slots
        self.mover: BlockMover | None = None
        self._pins: PinnedPool | None = None
        if slots:
            pool = make_host_pool(storage, slots, pin)
            self._pins = pool if isinstance(pool, PinnedPool) else None
            self.mover = BlockMover(storage, pool)

    @property
    def pinning(self) -> bool:
        """Slices are left to pin: the worker's loop calls pin_idle when it has time."""
        return self._pins is not None and not self._pins.done

    def pin_idle(self) -> bool:
        """Pin one more slice of the pool; False when none was left."""
        return self._pins is not None and self._pins.pin_idle()
