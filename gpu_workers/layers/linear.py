"""Tensor-parallel linear layers.

Column-parallel layers split the output features across ranks (no communication); row-parallel
layers split the input features and all-reduce the partial sums. Packed layers (QKV, gate-up)
hold several HF weights side by side; their loaders take a shard id saying which one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_workers.layers.parallel import TPInfo, divide


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class ColumnParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPInfo,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.tp = tp
        self.out_local = divide(out_features, tp.size, "output features")
        self.weight = _param((self.out_local, in_features), dtype, device)
        self.bias = _param((self.out_local,), dtype, device) if bias else None

    def load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        n = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp.rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stored back to back (gate_proj and up_proj)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, tp: TPInfo,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(in_features, sum(out_sizes), bias, tp, dtype, device)
        self.local_sizes = [divide(s, tp.size, "output features") for s in out_sizes]

    def load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        assert isinstance(shard_id, int)
        size = self.local_sizes[shard_id]
        offset = sum(self.local_sizes[:shard_id])
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp.rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul; each rank holds its heads of each."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 tp: TPInfo, dtype: torch.dtype, device: torch.device | str) -> None:
        self.num_heads = divide(num_heads, tp.size, "attention heads")
        self.num_kv_heads = divide(num_kv_heads, tp.size, "key/value heads")
        self.head_dim = head_dim
        total = (num_heads + 2 * num_kv_heads) * head_dim
        super().__init__(hidden, total, bias, tp, dtype, device)

    @property
    def sizes(self) -> tuple[int, int, int]:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return q, kv, kv

    def load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        index = "qkv".index(str(shard_id))
        size = self.sizes[index]
        offset = sum(self.sizes[:index])
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp.rank * size, size))


class RowParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPInfo,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.tp = tp
        self.in_local = divide(in_features, tp.size, "input features")
        self.weight = _param((out_features, self.in_local), dtype, device)
        self.bias = _param((out_features,), dtype, device) if bias else None

    def load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if param.dim() == 1:  # the bias is added once, after the reduction
            param.data.copy_(loaded)
            return
        n = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp.rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias
