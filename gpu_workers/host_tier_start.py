"""The host KV tier's pinned pool, allocated on a thread while the kernels warm up.

Pinning the host tier (on CUDA up to 16 GiB by default) takes seconds: the driver faults in,
zeroes and locks every page. Nothing reads the pool before the first step that moves blocks,
so a CUDA rank allocates it beside the warm-up and waits for it before CUDA graph capture (a
capture forbids other threads' calls that may synchronize) and so before it reports ready.
The slot count, which the ranks agree on with a collective, is settled on the main thread
first, so every rank's collectives stay in one order.
"""

from __future__ import annotations

import threading

import torch

from gpu_workers.block_mover import BlockMover, HostTierUnsupported, host_pool_slots, make_host_pool


class HostTierStart:
    """One rank's host tier in the making: `slots` at once, the mover from mover()."""

    def __init__(self, storage: torch.Tensor, gib: float, world_size: int,
                 drafter: object | None, background: bool | None = None) -> None:
        """`background`: allocate on a thread (default: when the pool is pinned, on CUDA)."""
        block_bytes = storage[:, :, 0].numel() * storage.element_size()
        slots = host_pool_slots(int(gib * 2**30), block_bytes)
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
        self._pool: torch.Tensor | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if slots == 0:
            return
        if background if background is not None else storage.is_cuda:
            self._thread = threading.Thread(target=self._allocate, name="host-kv-tier",
                                            daemon=True)
            self._thread.start()
        else:
            self._pool = make_host_pool(storage, slots)

    def _allocate(self) -> None:
        try:
            if self._storage.is_cuda:  # a new thread's device is 0: pin under the rank's own
                torch.cuda.set_device(self._storage.device)
            self._pool = make_host_pool(self._storage, self.slots)
        except BaseException as exc:  # noqa: BLE001 - raised on the main thread by mover()
            self._error = exc

    def mover(self) -> BlockMover | None:
        """Wait for the pool; the mover over it (None: no host tier). An allocation that
        failed raises here, so start-up fails with its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            raise self._error
        return None if self._pool is None else BlockMover(self._storage, self._pool)
