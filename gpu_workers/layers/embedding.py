"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_workers.layers.cpu_linear import cpu_linear
from gpu_workers.layers.parallel import TPInfo


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, tp: TPInfo, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        # Pad the vocabulary so it splits evenly; padded rows stay zero and are never sampled.
        self.shard = -(-vocab_size // tp.size)
        self.start = tp.rank * self.shard
        self.weight = nn.Parameter(
            torch.zeros(self.shard, hidden, dtype=dtype, device=device), requires_grad=False
        )

    def load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        rows = max(0, min(self.shard, self.vocab_size - self.start))
        param.data[:rows].copy_(loaded.narrow(0, self.start, rows))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.shard)
        y = F.embedding(local.masked_fill(outside, 0), self.weight)
        y = y.masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for the rows being sampled; the full vocabulary is assembled on rank 0."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPInfo, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__(vocab_size, hidden, tp, dtype, device)
        self.onednn_weight: torch.Tensor | None = None  # on the CPU, once loaded: cpu_linear

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        local = cpu_linear(hidden, self.weight, self.onednn_weight)
        full = self.tp.gather_last_dim(local)
        return None if full is None else full[:, : self.vocab_size]
