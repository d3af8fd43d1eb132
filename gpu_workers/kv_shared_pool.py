"""A KV pool another process on this host can map, and mapping one (--kv-transfer shared).

With shared pools a decode rank copies a handed-off request's blocks straight out of the
prefill rank's pool: one device copy, where the frames path makes two host copies and sends
the bytes through a socket. The prefill rank describes its pool once (KVPoolShare); the
decode rank maps it and keeps it mapped.

- **CUDA**: the pool's storage as torch shares it between processes
  (`UntypedStorage._share_cuda_`, a cudaIpcMemHandle and where the storage sits in its
  allocation), opened with `_new_shared_cuda`, and the GPU's UUID: the handle's device index
  is the prefill process's, and with a GPU group per replica the two processes number their
  GPUs otherwise (each sees its own group first: frontend.engine.disagg_gpus). Only a
  process that sees the pool's GPU can open the handle. On one GPU the replicas share, the
  decode rank opens it on that GPU, as any IPC consumer does. On another GPU of the host it
  opens it **on its own GPU**, not the pool's: `_new_shared_cuda(device, ...)` makes
  `device` current and opens the handle there (`cudaIpcOpenMemHandle` with
  `cudaIpcMemLazyEnablePeerAccess`), mapping the peer's memory into the decode GPU's context
  that already exists and enabling peer access to the pool's GPU, and labels the storage
  with that device. The gather then runs on the decode GPU and reads the pool over NVLink.
  Opening it on the pool's index instead would make that GPU current in this process: a
  second CUDA context (hundreds of MiB of the prefill GPU's memory per decode rank), a
  storage labelled with the prefill GPU, so the gather would run there, beside the prefill
  replica's steps, and then cross to this one. The decode rank checks peer access first
  (`torch.cuda.can_device_access_peer`) and refuses the pool, naming --kv-transfer frames,
  when there is none (the launcher refuses or avoids that case before start-up).
- **CPU**: the pool is allocated in a memfd (anonymous memory: nothing to clean up when the
  process dies, and no /dev/shm size limit), which the decode rank opens read-only as
  /proc/PID/fd/FD: the kernel lets a process of the same user do that.
Nothing is unpickled: the description is a typed msgpack message.
"""

from __future__ import annotations

import math
import mmap
import os
import warnings
from collections.abc import Callable

import torch

from gpu_workers.block_mover import BLOCK_DIM
from protocol.kv_handoff import CudaPoolHandle, KVPoolShare


def memfd_pool(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """A zeroed CPU tensor living in a fresh memfd, and the memfd's descriptor (kept open
    for the life of the process: it is how another process finds the memory)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    fd = os.memfd_create("nanopipe-kv-pool", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    mapped = mmap.mmap(fd, nbytes)  # memfd pages start zeroed
    return torch.frombuffer(mapped, dtype=torch.uint8).view(dtype).view(shape), fd


def describe_pool(pool: torch.Tensor, fd: int, replica: int) -> KVPoolShare:
    """What a decode rank needs to map `pool` (a CPU pool must live in memfd `fd`)."""
    cuda = None
    if pool.is_cuda:
        fields = pool.untyped_storage()._share_cuda_()
        cuda = CudaPoolHandle(*fields, device_uuid=gpu_uuids()[pool.device.index])
        fd = -1
    elif fd < 0:
        raise ValueError("a CPU KV pool must be allocated in a memfd to be shared")
    return KVPoolShare(replica, str(pool.dtype), list(pool.shape), os.getpid(), fd, cuda)


class PoolMismatch(ValueError):
    """A peer's pool that this rank's blocks cannot be copied from."""


def map_pool(share: KVPoolShare, own: torch.Tensor) -> torch.Tensor:
    """The prefill rank's pool described by `share`, mapped into this process, checked
    against `own` (this rank's pool: same dtype, same block layout). Raises PoolMismatch or
    OSError with the reason."""
    expected = list(own.shape)
    expected[BLOCK_DIM] = share.shape[BLOCK_DIM] if len(share.shape) == len(expected) else -1
    if share.dtype != str(own.dtype):
        raise PoolMismatch(f"prefill replica {share.prefill_replica}'s KV pool holds "
                           f"{share.dtype}, this one {own.dtype} (prefill and decode replicas "
                           "must run one --dtype and --kv-cache-dtype)")
    if share.shape != expected:
        raise PoolMismatch(f"prefill replica {share.prefill_replica}'s KV pool has shape "
                           f"{share.shape}, which does not match this one's {list(own.shape)} "
                           "outside the block count")
    if (share.cuda is not None) != own.is_cuda:
        raise PoolMismatch(f"prefill replica {share.prefill_replica}'s KV pool is on "
                           f"{'cuda' if share.cuda else 'the cpu'}, this one on {own.device}")
    if share.cuda is not None:
        return _map_cuda(share, own)
    return _map_memfd(share, own.dtype)


def _map_cuda(share: KVPoolShare, own: torch.Tensor) -> torch.Tensor:
    h, mine = share.cuda, own.device.index
    source_gpu(share, mine, gpu_uuids(), torch.cuda.can_device_access_peer)
    storage = torch.UntypedStorage._new_shared_cuda(  # opened on this rank's GPU: above
        mine, h.handle, h.size_bytes, h.offset_bytes, h.ref_counter_handle,
        h.ref_counter_offset, h.event_handle, h.event_sync_required)
    numel = math.prod(share.shape)
    flat = torch.empty(0, dtype=own.dtype, device=own.device)
    return flat.set_(storage, 0, (numel,), (1,)).view(share.shape)


def gpu_uuids() -> list[str]:
    """The UUID of each GPU this process sees, by index (no CUDA context on any of them)."""
    return [str(torch.cuda.get_device_properties(i).uuid)
            for i in range(torch.cuda.device_count())]


def source_gpu(share: KVPoolShare, mine: int, uuids: list[str],
               can_access: Callable[[int, int], bool]) -> int:
    """This process's index of the GPU holding `share`'s pool, checked: the rank on GPU
    `mine` sees it (`uuids`: this process's GPUs by index) and, on another GPU, can read its
    memory directly. Raises PoolMismatch with the reason."""
    h, who = share.cuda, f"prefill replica {share.prefill_replica}'s KV pool"
    if not h.device_uuid:  # a peer that does not say: the same numbering, one GPU
        source = h.device
    elif h.device_uuid in uuids:
        source = uuids.index(h.device_uuid)
    else:
        raise PoolMismatch(f"{who} is on GPU {h.device_uuid}, which this rank (GPU "
                           f"{uuids[mine]}) does not see; use --kv-transfer frames")
    if source != mine and not can_access(mine, source):
        raise PoolMismatch(f"{who} is on cuda:{source}, which this rank's cuda:{mine} has no "
                           "peer access to; use --kv-transfer frames")
    return source


def _map_memfd(share: KVPoolShare, dtype: torch.dtype) -> torch.Tensor:
    nbytes = math.prod(share.shape) * torch.empty((), dtype=dtype).element_size()
    with open(f"/proc/{share.pid}/fd/{share.fd}", "rb") as f:
        mapped = mmap.mmap(f.fileno(), nbytes, access=mmap.ACCESS_READ)
    with warnings.catch_warnings():  # read only: blocks are copied out of it, never into it
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(mapped, dtype=torch.uint8)
    return raw.view(dtype).view(share.shape)
