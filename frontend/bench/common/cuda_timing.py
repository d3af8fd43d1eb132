"""Kernel timing on a CUDA GPU: CUDA events around a loop, or around a graph of many calls
(as a captured decode step launches them), and a paged KV cache to time attention on."""

from __future__ import annotations

import torch

LAYERS = 28
"""Calls per captured graph: one per layer of the Qwen3-0.6B shape."""


def bench(fn, iters: int) -> float:
    """Mean milliseconds per call over `iters`, after warm-up."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def bench_graphed(fn, iters: int, reps: int = LAYERS) -> float:
    """Mean microseconds per call of `fn`, replayed `reps` times per CUDA graph (one per layer,
    as in a captured decode step), so launch gaps count as they do there."""
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return bench(graph.replay, iters) * 1e3 / reps


def bench_graphed_over(fn, weights: list[torch.Tensor], iters: int) -> float:
    """Mean microseconds per call of fn(w), one call per weight in one CUDA graph (distinct
    weights, as a decode step's layers have, so none is read from L2)."""
    fn(weights[0])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(w)
    return bench(graph.replay, iters) * 1e3 / len(weights)


def make_cache(seq_lens: list[int], block_size: int, width: int = 0, kv_heads: int = 8,
               head_dim: int = 128, dtype: torch.dtype = torch.bfloat16):
    """A paged cache holding these contexts; the block table is `width` blocks wide when that is
    wider than the longest context needs (a CUDA graph's table is as wide as max_model_len)."""
    nblocks = [-(-n // block_size) for n in seq_lens]
    total = sum(nblocks)
    perm = torch.randperm(total)
    table = torch.zeros(len(seq_lens), max(max(nblocks), width), dtype=torch.int32)
    used = 0
    for b, n in enumerate(nblocks):
        table[b, :n] = perm[used:used + n].to(torch.int32)
        used += n
    shape = (total, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device="cuda")
    v_cache = torch.randn(shape, dtype=dtype, device="cuda")
    return k_cache, v_cache, table.cuda()
