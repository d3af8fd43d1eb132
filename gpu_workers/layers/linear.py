"""Tensor-parallel linear layers.

Column-parallel layers split the output features across ranks (no communication); row-parallel
layers split the input features and all-reduce the partial sums. Shards may be uneven (see
protocol.head_partition): each layer knows the global range of features its rank holds. Packed
layers (QKV, gate-up) hold several HF weights side by side; their loaders take a shard id saying
which one, and `packed_shards` lists the parts of a checkpoint that stores them already packed.
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_workers.layers.cpu_linear import cpu_linear
from gpu_workers.layers.parallel import TPInfo
from kernels.activation import silu_and_mul
from kernels.skinny_linear import gated_linear, linear
from protocol.head_partition import even_split, partition_heads


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def _copy_rows(dst: torch.Tensor, loaded: torch.Tensor, rows: range) -> None:
    dst.copy_(loaded.narrow(0, rows.start, len(rows)))


class ColumnParallelLinear(nn.Module):
    """Holds, on each rank, the rows of the full weight listed in `row_ranges` (back to back)."""

    def __init__(self, in_features: int, row_ranges: list[range], bias: bool, tp: TPInfo,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.tp = tp
        self.row_ranges = row_ranges
        self.local_sizes = [len(r) for r in row_ranges]
        self.out_local = sum(self.local_sizes)
        self.weight = _param((self.out_local, in_features), dtype, device)
        self.bias = _param((self.out_local,), dtype, device) if bias else None
        self.onednn_weight: torch.Tensor | None = None  # on the CPU, once loaded: cpu_linear

    def _load_part(self, param: nn.Parameter, loaded: torch.Tensor, index: int) -> None:
        offset = sum(self.local_sizes[:index])
        _copy_rows(param.data.narrow(0, offset, self.local_sizes[index]), loaded,
                   self.row_ranges[index])

    def load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        self._load_part(param, loaded, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cuda:  # the skinny kernel is CUDA's
            return cpu_linear(x, self.weight, self.onednn_weight, self.bias)
        return linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stored back to back (gate_proj and up_proj), each split
    as evenly as possible."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, tp: TPInfo,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        ranges = [even_split(s, tp.size)[tp.rank] for s in out_sizes]
        super().__init__(in_features, ranges, bias, tp, dtype, device)
        self.packed_shards = tuple(enumerate(out_sizes))

    def load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        assert isinstance(shard_id, int)
        self._load_part(param, loaded, shard_id)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul; each rank holds its heads of each
    (partition_heads: whole KV-head groups, or a share of one replicated group)."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 tp: TPInfo, dtype: torch.dtype, device: torch.device | str) -> None:
        shard = partition_heads(num_heads, num_kv_heads, tp.size)[tp.rank]
        self.q_heads = shard.q_heads
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads
        self.head_dim = d = head_dim
        q = range(shard.q_heads.start * d, shard.q_heads.stop * d)
        kv = range(shard.kv_heads.start * d, shard.kv_heads.stop * d)
        super().__init__(hidden, [q, kv, kv], bias, tp, dtype, device)
        self.packed_shards = (("q", num_heads * d), ("k", num_kv_heads * d),
                              ("v", num_kv_heads * d))

    @property
    def sizes(self) -> tuple[int, int, int]:
        q, k, v = self.local_sizes
        return q, k, v

    def load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        self._load_part(param, loaded, "qkv".index(str(shard_id)))


class RowParallelLinear(nn.Module):
    """Holds the input columns `cols` of the full weight; the partial products are summed."""

    def __init__(self, cols: range, out_features: int, bias: bool, tp: TPInfo,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.tp = tp
        self.cols = cols
        self.in_local = len(cols)
        self.weight = _param((out_features, self.in_local), dtype, device)
        self.bias = _param((out_features,), dtype, device) if bias else None
        self.onednn_weight: torch.Tensor | None = None  # on the CPU, once loaded: cpu_linear

    @classmethod
    def even(cls, in_features: int, out_features: int, bias: bool, tp: TPInfo,
             dtype: torch.dtype, device: torch.device | str) -> RowParallelLinear:
        return cls(even_split(in_features, tp.size)[tp.rank], out_features, bias, tp, dtype,
                   device)

    def load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if param.dim() == 1:  # the bias is added once, after the reduction
            param.data.copy_(loaded)
            return
        param.data.copy_(loaded.narrow(1, self.cols.start, self.in_local))

    def forward(self, x: torch.Tensor, gated: bool = False) -> torch.Tensor:
        """`gated`: x is the gate/up projection's output, and this layer's input is
        silu(gate) * up (one kernel with the product at decode's few rows)."""
        if not x.is_cuda:
            x = silu_and_mul(x) if gated else x
            y = cpu_linear(x, self.weight, self.onednn_weight)
        else:
            y = gated_linear(x, self.weight) if gated else linear(x, self.weight)
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias
