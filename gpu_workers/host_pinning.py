"""The host KV tier's pool, page-locked a slice at a time while the worker has nothing to do.

Page-locking (registering) host memory for the GPU's DMA holds the process's memory-map lock
while the kernel faults in and locks every page, and CUDA's own lock while the driver maps
them. The host tier is up to 16 GiB: registered in one call, as torch's pinned allocator does,
it stalled the start-up's warm-up for seconds (docs/startup.md); registered a 16 MiB slice
at a time on a thread beside serving, each slice made the worker's launches wait, and a
throughput run right after start-up ran at a third of its speed until the pool was done.

So the pool is memory this process maps itself (untouched pages cost nothing) and is
registered on the worker's own thread, a slice of whole KV blocks at a time: by
`pin_idle` when no step has come for a while, and by `ensure` for the slices a copy is about
to use that idle time has not reached yet. A step then waits for one slice at most, and only
one that arrives while the worker is pinning; a run that never moves a block to the host
never pays for the tier. A copy stays within one registration (BlockMover splits its runs at
slice edges), and the slices are unregistered before the memory is unmapped, when the last
tensor viewing it is freed. A slice CUDA refuses stays pageable, as do the rest: copies to
and from them are correct but wait for the host.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from collections.abc import Callable, Iterable

import torch

log = logging.getLogger("nanopipe.worker")
SLICE_BYTES = 16 << 20
"""How much one registration locks: milliseconds of faulting and mapping (a KV block larger
than this is a slice of its own)."""

Register = Callable[[int, int], None]
"""register(address, nbytes): lock the range for the device's DMA, or raise."""
Unregister = Callable[[int], None]

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class HostRegistrationError(RuntimeError):
    """CUDA refused to register a slice (it stays pageable memory)."""


def cuda_register(address: int, nbytes: int) -> None:
    code = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)
    if int(code) != 0:
        raise HostRegistrationError(f"cudaHostRegister of {nbytes} bytes failed: error "
                                    f"{int(code)}")


def cuda_unregister(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)


class _Mapping:
    """Anonymous memory of this process and the slices of it registered so far."""

    def __init__(self, nbytes: int, unregister: Unregister) -> None:
        address = _libc.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE,
                             mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if address in (None, _MAP_FAILED):
            raise MemoryError(f"could not map {nbytes} bytes for the host KV tier "
                              f"(errno {ctypes.get_errno()})")
        self.address = address
        self.nbytes = nbytes
        self.registered: list[int] = []
        self._unregister = unregister

    def __del__(self) -> None:
        for address in self.registered:
            try:
                self._unregister(address)
            except Exception:  # noqa: BLE001 - at exit CUDA may already be gone
                pass
        self.registered.clear()
        _libc.munmap(self.address, self.nbytes)


def slice_slots(slot_bytes: int, slice_bytes: int = SLICE_BYTES) -> int:
    """Whole slots per registered slice: at least one, however large a slot is."""
    return max(1, slice_bytes // slot_bytes)


class PinnedPool:
    """An uninitialised tensor of `shape` (slots first) in memory this process maps, page-locked
    a slice of whole slots at a time: `ensure` before a copy, `pin_idle` while idle."""

    def __init__(self, shape: list[int], dtype: torch.dtype, *,
                 slice_bytes: int = SLICE_BYTES, register: Register | None = None,
                 unregister: Unregister | None = None) -> None:
        """`register`/`unregister`: CUDA's by default (tests stand in for them)."""
        slot_bytes = torch.Size(shape[1:]).numel() * dtype.itemsize
        nbytes = max(1, shape[0] * slot_bytes)
        self._mapping = _Mapping(nbytes, unregister or cuda_unregister)
        self._register = register or cuda_register
        self.slice_slots = slice_slots(slot_bytes, slice_bytes)
        self._slice_bytes = self.slice_slots * slot_bytes
        self._pinned = [False] * -(-nbytes // self._slice_bytes)
        self._next = 0  # every slice below it is pinned
        self.error: HostRegistrationError | None = None
        buffer = (ctypes.c_char * nbytes).from_address(self._mapping.address)
        buffer._mapping = self._mapping  # freed with the last view: see _Mapping.__del__
        self.tensor = torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)

    @property
    def done(self) -> bool:
        """Every slice is pinned, or CUDA refused one (the rest then stay pageable)."""
        return self.error is not None or self._next == len(self._pinned)

    @property
    def pinned_slices(self) -> int:
        return len(self._mapping.registered)

    def ensure(self, slots: Iterable[int]) -> None:
        """Pin the slices holding these slots, those not pinned yet."""
        if self.done:
            return
        for index in sorted({slot // self.slice_slots for slot in slots}):
            self._pin(index)

    def pin_idle(self) -> bool:
        """Pin the lowest slice not pinned yet; False when there was none left to pin."""
        if self.done:
            return False
        self._pin(self._next)
        return True

    def _pin(self, index: int) -> None:
        if self._pinned[index] or self.error is not None:
            return
        address = self._mapping.address + index * self._slice_bytes
        nbytes = min(self._slice_bytes, self._mapping.nbytes - index * self._slice_bytes)
        try:
            self._register(address, nbytes)
        except HostRegistrationError as exc:
            self.error = exc.with_traceback(None)  # no frame of this pool's kept alive by it
            log.warning("host KV tier: %s after %d of %d slices; the rest stay in pageable "
                        "memory, whose copies wait for the host", str(exc), self.pinned_slices,
                        len(self._pinned))
            return
        self._mapping.registered.append(address)
        self._pinned[index] = True
        while self._next < len(self._pinned) and self._pinned[self._next]:
            self._next += 1
