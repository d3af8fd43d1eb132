"""One-shot all-reduce through the peers' memory, for the small activations of decode steps.

A tensor-parallel decode step all-reduces its hidden states twice per layer. Those tensors are
small (batch x hidden x 2 bytes, about 1 MiB), and NCCL's ring takes ~12 us for each on two
H200s: latency, not bandwidth. Here every rank copies its partial into a buffer the other ranks
map (PyTorch's symmetric memory, over NVLink peer access, no multicast), and one kernel on each
rank sums all partials straight out of the peers' buffers, in rank order on every rank, so the
ranks' sums are bitwise equal. Tensors larger than the buffer (prefill chunks) keep NCCL.

Symmetric memory needs every rank on one host with peer access between their GPUs; the ranks
check that together and all of them use it or none does.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import xxhash

log = logging.getLogger("nanopipe.worker")

MAX_BYTES = 8 << 20
"""The buffer: a decode step of 1,024 sequences at hidden size 4,096 in bf16. Larger tensors
are prefill chunks, whose all-reduce NCCL does at full bandwidth."""


@dataclass(frozen=True, slots=True)
class PeerAllReduce:
    buffer: torch.Tensor
    """This rank's slot of the symmetric allocation, flat."""
    group_name: str

    def fits(self, x: torch.Tensor) -> bool:
        return (x.device == self.buffer.device and x.dtype == self.buffer.dtype
                and x.is_contiguous() and x.numel() <= self.buffer.numel())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x` (a new tensor; `x` is left as it was)."""
        out = torch.empty_like(x)
        slot = self.buffer[:x.numel()].view_as(x)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(slot, x, "sum", self.group_name, out)
        return out


def create_peer_all_reduce(dtype: torch.dtype, device: torch.device,
                           max_bytes: int = MAX_BYTES) -> PeerAllReduce | None:
    """Called by every rank of the default group together: a reducer on all, or None on all
    (with the reason logged) where symmetric memory cannot work."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or device.type != "cuda":
        return None
    reason = _local_obstacle(device)
    if not _all_agree(reason is None, device):
        log.info("all-reduce through NCCL only: %s", reason or "another rank cannot map peers")
        return None
    from torch.distributed import _symmetric_memory as symm_mem

    group_name = dist.group.WORLD.group_name
    buffer = symm_mem.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device)
    symm_mem.rendezvous(buffer, group_name)
    return PeerAllReduce(buffer, group_name)


def _local_obstacle(device: torch.device) -> str | None:
    """Why this rank cannot take part (None: it can): the op, one host, peer access. Every
    rank gets as far as the all-gather, whatever it finds before."""
    mine = torch.tensor([_host_id(), device.index], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out"):
        return f"torch {torch.__version__} lacks symm_mem.one_shot_all_reduce_copy_out"
    hosts = {int(t[0]) for t in everyone}
    if len(hosts) > 1:
        return "the ranks span several hosts"
    for t in everyone:
        peer = int(t[1])
        if peer != device.index and not torch.cuda.can_device_access_peer(device.index, peer):
            return f"GPU {device.index} cannot access GPU {peer} directly"
    return None


def _all_agree(ok: bool, device: torch.device) -> bool:
    flag = torch.tensor([int(ok)], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _host_id() -> int:
    """The host's name and boot: containers of two hosts may share a name, not a boot id."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    text = socket.gethostname() + (boot.read_text() if boot.exists() else "")
    return xxhash.xxh64_intdigest(text) >> 1  # fits int64
