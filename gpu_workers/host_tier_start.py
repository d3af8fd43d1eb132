"""The host KV tier's pinned pool, allocated on a thread once the rank is otherwise ready.

Pinning the host tier (on CUDA up to 16 GiB by default) takes seconds: the kernel faults in,
zeroes and locks every page and the driver maps them. Made in one call, beside the warm-up,
it stalled the warm-up's scratch tables and staging buffers, which map memory (the warm-up
took 12 s on one H200 host, 3 s on another: docs/startup.md); the pool is now pinned a
slice at a time (gpu_workers.host_pinning), so another thread waits for one slice at most.
Nothing reads the pool before the first step that moves blocks out of the device pool, which
a fresh engine takes only once that pool is full, so a CUDA rank starts pinning after its
CUDA graphs are captured (`begin`), reports ready at once, and the first use of the mover
waits for the pool (`mover`), as does a later graph capture (a capture forbids other
threads' calls that may synchronize). Should pinning fail, the tier keeps its slots in
pageable memory: its copies then wait for the host, and no block the scheduler places there
is lost. The slot count, which the ranks agree on with a collective, is settled on the main
thread first, so every rank's collectives stay in one order.

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
import threading
from collections.abc import Mapping

import torch

from gpu_workers.block_mover import BlockMover, HostTierUnsupported, host_pool_slots, make_host_pool

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


class HostTierStart:
    """One rank's host tier in the making: `slots` at once, the pool from begin() on, the
    mover from mover()."""

    def __init__(self, storage: torch.Tensor, gib: float, world_size: int,
                 drafter: object | None, background: bool | None = None) -> None:
        """`background`: allocate on a thread (default: when the pool is pinned, on CUDA)."""
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
        self._storage = storage
        self._background = storage.is_cuda if background is None else background
        self._pool: torch.Tensor | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def begin(self) -> None:
        """Start making the pool: on a thread, or at once (a failure then raises here)."""
        if self.slots == 0 or self._thread is not None or self._pool is not None:
            return
        if self._background:
            # Not a daemon: a process that stops while it pins waits for it at exit, rather
            # than tearing CUDA down under a registration in progress.
            self._thread = threading.Thread(target=self._allocate, name="host-kv-tier")
            self._thread.start()
        else:
            self._pool = make_host_pool(self._storage, self.slots)

    def _allocate(self) -> None:
        try:
            if self._storage.is_cuda:  # a new thread's device is 0: pin under the rank's own
                torch.cuda.set_device(self._storage.device)
            self._pool = make_host_pool(self._storage, self.slots)
        except BaseException as exc:  # noqa: BLE001 - settled on the main thread by mover()
            self._error = exc

    def mover(self) -> BlockMover | None:
        """Wait for the pool (beginning it if no one did); the mover over it (None: no host
        tier). A pinned pool that could not be made is made in pageable memory instead."""
        self.begin()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            log.warning("host KV tier: pinning %d slots failed (%s); keeping them in pageable "
                        "memory, whose copies wait for the host", self.slots, self._error)
            self._error = None
            self._pool = make_host_pool(self._storage, self.slots, pin=False)
        return None if self._pool is None else BlockMover(self._storage, self._pool)
