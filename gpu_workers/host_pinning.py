"""A large pinned host buffer, locked a slice at a time so no call holds the host for long.

Pinning the host KV tier (16 GiB by default) in one call, as torch's pinned allocator does,
holds the process's memory-map lock while the kernel faults in and locks every page, and
CUDA's own lock while the driver maps them: seconds in which the worker's other threads can
neither map memory nor make CUDA calls. Beside the start-up's warm-up that cost 12 s (see
docs/startup.md); after it, the same stall would land in the first seconds of serving.

Here the buffer is mapped by the process itself and registered with CUDA in slices of
`SLICE_BYTES` (whole KV blocks each), one after another, so any other thread waits for one
slice at most. A copy stays within one registration (BlockMover splits its runs at slice
bounds), and the slices are unregistered before the memory is unmapped, when the last tensor
viewing the buffer is freed.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Callable

import torch

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
    """CUDA refused to register a slice (the caller falls back to another kind of memory)."""


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


def pinned_slots(shape: list[int], dtype: torch.dtype, *, slice_bytes: int = SLICE_BYTES,
                 register: Register = cuda_register,
                 unregister: Unregister = cuda_unregister) -> torch.Tensor:
    """An uninitialised tensor of `shape` (slots first) in page-locked host memory, registered
    a slice of whole slots at a time; a failed registration raises after undoing the
    others."""
    slot_bytes = torch.Size(shape[1:]).numel() * dtype.itemsize
    nbytes = max(1, shape[0] * slot_bytes)
    mapping = _Mapping(nbytes, unregister)
    step = slice_slots(slot_bytes, slice_bytes) * slot_bytes
    for offset in range(0, nbytes, step):
        register(mapping.address + offset, min(step, nbytes - offset))
        mapping.registered.append(mapping.address + offset)
    buffer = (ctypes.c_char * nbytes).from_address(mapping.address)
    buffer._mapping = mapping  # freed with the last view of the buffer: see _Mapping.__del__
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)
