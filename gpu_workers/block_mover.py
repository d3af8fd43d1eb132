"""Batched KV block copies between a rank's device pool and its host tier.

A pool is one tensor [2, num_layers, num_blocks, block_size, kv_heads, head_dim] (see
kv_cache.KVCache), so a list of blocks is one index along dim 2 across every layer at once:
a move is one gather on the source, one transfer, one scatter on the destination, whatever
the number of blocks and layers. gather/scatter take any two pools of that layout, so moving
a request's blocks from one pipeline's rank i to another's rank i uses the same calls.

The host pool is block-major ([slots, 2, num_layers, block_size, kv_heads, head_dim]): a run
of consecutive slots is one contiguous stretch, so it crosses the bus as one copy. On CUDA it
is pinned and every copy is asynchronous on a side stream (see BlockMover). On CPU the copies
are plain and synchronous. Both pools hold the cache's dtype (an fp8 cache's host tier is
fp8 too); scatters copy bytes (kv_quant.raw), which torch does for every dtype.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from gpu_workers.host_pinning import PinnedPool
from kernels.kv_quant import raw
from protocol.process_runtime import ExplainedStartupError
from protocol.step_messages import BlockMoves

BLOCK_DIM = 2


class HostTierUnsupported(ExplainedStartupError):
    """A host tier asked of a configuration it cannot serve."""


class HostPoolTooSmall(ExplainedStartupError):
    """A host tier that cannot hold a single block."""


def host_pool_slots(size_bytes: int, bytes_per_block: int) -> int:
    """Slots a host tier of size_bytes holds; 0 means the tier is off. A positive size below
    one block is refused: it would silently turn the tier off."""
    if size_bytes <= 0:
        return 0
    slots = size_bytes // bytes_per_block
    if slots == 0:
        raise HostPoolTooSmall(
            f"kv_offloading_size of {size_bytes} bytes cannot hold one KV block of "
            f"{bytes_per_block} bytes; raise it (--kv-offloading-size, GiB) or set 0 to turn "
            "the host tier off")
    return slots


def gather_blocks(pool: torch.Tensor, block_ids: Seq[int]) -> torch.Tensor:
    """The listed blocks of every layer, K and V, as one contiguous tensor."""
    index = torch.as_tensor(list(block_ids), dtype=torch.long, device=pool.device)
    return pool.index_select(BLOCK_DIM, index)


def scatter_blocks(pool: torch.Tensor, block_ids: Seq[int], blocks: torch.Tensor) -> None:
    """Write gathered blocks (in the order of block_ids) into pool."""
    index = torch.as_tensor(list(block_ids), dtype=torch.long, device=pool.device)
    raw(pool).index_copy_(BLOCK_DIM, index, raw(blocks.to(pool.device, non_blocking=True)))


def block_major(pool: torch.Tensor) -> torch.Tensor:
    """A view of a pool with the block index first: [num_blocks, 2, layers, ...]."""
    return pool.movedim(BLOCK_DIM, 0)


def slot_runs(slots: Seq[int], bound: int | None = None) -> list[tuple[int, int, int]]:
    """(position, first slot, count) for each run of consecutive slots in the list: a run is
    one contiguous stretch of the host pool, so it moves as one copy. With `bound`, a run
    also ends where a slot index is a multiple of it (a registered slice's edge: one copy
    stays within one registration, see gpu_workers.host_pinning)."""
    runs: list[tuple[int, int, int]] = []
    for position, slot in enumerate(slots):
        joins = runs and runs[-1][1] + runs[-1][2] == slot
        if joins and not (bound and slot % bound == 0):
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((position, slot, 1))
    return runs


def make_host_pool(device_pool: torch.Tensor, num_slots: int,
                   pin: bool | None = None) -> torch.Tensor | PinnedPool:
    """A host pool of num_slots blocks, block index first so that each block, and each run
    of consecutive slots, is one contiguous stretch of memory; under CUDA, unless `pin` says
    otherwise, a PinnedPool, which page-locks it a slice at a time
    (gpu_workers.host_pinning)."""
    shape = list(block_major(device_pool).shape)
    shape[0] = num_slots
    pin = device_pool.is_cuda if pin is None else pin
    if pin:
        return PinnedPool(shape, device_pool.dtype)
    return torch.empty(shape, dtype=device_pool.dtype, device="cpu")


class BlockMover:
    """Executes a step's host-tier moves for one rank.

    Under CUDA every copy runs on a side stream and the host never waits: a store gathers
    its blocks on the device (the compute stream waits only for that gather before it may
    overwrite them) and then copies to the pinned host pool; a load copies each run of host
    slots to a device staging buffer and scatters it into the pool, and the compute stream
    waits for it before the forward that reads the blocks. Both go in issue order on one
    stream, so a load always sees the stores before it.
    """

    def __init__(self, device_pool: torch.Tensor, host_pool: torch.Tensor | PinnedPool) -> None:
        """A PinnedPool's slices are pinned before a copy uses them, and no copy crosses a
        slice's edge."""
        pins = host_pool if isinstance(host_pool, PinnedPool) else None
        if pins is not None:
            host_pool = pins.tensor
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.block_bytes = host_pool[0].numel() * host_pool.element_size()
        self._cuda = device_pool.is_cuda
        self._pins = pins
        self._slice_slots = None if pins is None else pins.slice_slots
        self._stream = torch.cuda.Stream(device_pool.device) if self._cuda else None
        self._loaded: torch.cuda.Event | None = None
        self.bytes_stored = 0
        self.bytes_loaded = 0

    def _index(self, block_ids: Seq[int]) -> torch.Tensor:
        return torch.as_tensor(list(block_ids), dtype=torch.long).to(
            self.device_pool.device, non_blocking=True)

    def store(self, device_blocks: Seq[int], host_slots: Seq[int]) -> None:
        """Copy device blocks to host slots. Blocks are read after everything the compute
        stream has queued, so a block written by the step before is complete."""
        if not device_blocks:
            return
        if not self._cuda:
            slots = torch.as_tensor(list(host_slots), dtype=torch.long)
            self.host_pool[slots] = block_major(self.device_pool)[self._index(device_blocks)]
        else:
            if self._pins is not None:
                self._pins.ensure(host_slots)
            compute = torch.cuda.current_stream(self.device_pool.device)
            self._stream.wait_stream(compute)
            with torch.cuda.stream(self._stream):
                staged = block_major(self.device_pool)[self._index(device_blocks)]
                gathered = torch.cuda.Event()
                gathered.record(self._stream)
                for position, slot, count in slot_runs(host_slots, self._slice_slots):
                    self.host_pool[slot:slot + count].copy_(
                        staged[position:position + count], non_blocking=True)
            compute.wait_event(gathered)  # the blocks may be handed out again after this
        self.bytes_stored += len(device_blocks) * self.block_bytes

    def load(self, host_slots: Seq[int], device_blocks: Seq[int]) -> None:
        """Copy host slots into device blocks; under CUDA asynchronously on the side stream
        (call wait_loads before the forward that reads them)."""
        if not host_slots:
            return
        if not self._cuda:
            slots = torch.as_tensor(list(host_slots), dtype=torch.long)
            raw(self.device_pool).index_copy_(BLOCK_DIM, self._index(device_blocks),
                                              raw(self.host_pool[slots].movedim(0, BLOCK_DIM)))
        else:
            if self._pins is not None:
                self._pins.ensure(host_slots)
            with torch.cuda.stream(self._stream):
                index = self._index(device_blocks)
                staged = torch.empty((len(host_slots), *self.host_pool.shape[1:]),
                                     dtype=self.host_pool.dtype, device=self.device_pool.device)
                for position, slot, count in slot_runs(host_slots, self._slice_slots):
                    staged[position:position + count].copy_(
                        self.host_pool[slot:slot + count], non_blocking=True)
                # The device blocks may have been read by steps still queued (a freed block
                # handed out again): wait for them before overwriting.
                self._stream.wait_stream(torch.cuda.current_stream(self.device_pool.device))
                raw(self.device_pool).index_copy_(BLOCK_DIM, index,
                                                  raw(staged.movedim(0, BLOCK_DIM)))
                self._loaded = torch.cuda.Event()
                self._loaded.record(self._stream)
        self.bytes_loaded += len(host_slots) * self.block_bytes

    def apply(self, moves: BlockMoves) -> None:
        """A plan's moves: stores, then loads, then the compute stream waits for the loads."""
        self.store(moves.store_device_blocks, moves.store_host_slots)
        self.load(moves.load_host_slots, moves.load_device_blocks)
        self.wait_loads()

    def wait_loads(self) -> None:
        """Order the compute stream after every load issued so far."""
        if self._loaded is not None:
            torch.cuda.current_stream(self.device_pool.device).wait_event(self._loaded)
            self._loaded = None

    def synchronize(self) -> None:
        """Wait on the host until every copy issued so far is complete (tests, shutdown)."""
        if self._stream is not None:
            self._stream.synchronize()
