"""Tensor-parallel placement: which rank this is, and the collectives the layers need."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from gpu_workers.layers.peer_all_reduce import PeerAllReduce


@dataclass(frozen=True, slots=True)
class TPInfo:
    rank: int = 0
    size: int = 1
    peers: PeerAllReduce | None = field(default=None, compare=False, repr=False)
    """The one-shot all-reduce for tensors that fit its buffer, where the ranks share a host."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks: `x` itself, reduced in place, or a new tensor."""
        if self.size == 1:
            return x
        if self.peers is not None and self.peers.fits(x):
            return self.peers(x)
        dist.all_reduce(x)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's shard of the last dim on rank 0 (None elsewhere)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1) if self.rank == 0 else None

