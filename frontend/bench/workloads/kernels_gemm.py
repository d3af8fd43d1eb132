"""The decode step's projections and logits at W1's batch (~150-260 rows), where a step's
matrix products cost about three times the time their weights take to read (an H200 profile of
W1: 0.83 ms a step against ~0.3 ms). Each projection runs from one CUDA graph of 28 distinct
weights (no weight read from L2), as cuBLAS is called today (F.linear: x @ Wᵀ) and with the
weight stored transposed (x @ W, another of cuBLAS's kernels for the same product); the tied
logits head once a step. Printed: microseconds per call, the weight's read time at the copy
bandwidth and the FLOPs' time at the matmul rate (both measured at the start of the run,
frontend.bench.ceilings), whichever is larger being the floor.

    nanopipe bench kernels --only gemm
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from frontend.bench.ceilings import DeviceCeilings
from frontend.bench.common.cuda_timing import LAYERS, bench_graphed_over

PROJECTIONS = {"qkv_proj": (4096, 1024), "o_proj": (1024, 2048),
               "gate_up_proj": (6144, 1024), "down_proj": (1024, 3072)}
"""Qwen3-0.6B's (out, in) per layer."""
VOCAB = 151_936
ROWS = (153, 256)


def floor_us(rows: int, n: int, k: int, ceilings: DeviceCeilings) -> float:
    """The least microseconds x @ Wᵀ of `rows` rows takes for a bf16 weight (n, k): its read,
    or its FLOPs, whichever takes longer."""
    read = n * k * 2 / ceilings.copy_bytes_per_s
    compute = 2 * rows * n * k / ceilings.matmul_flops_per_s
    return max(read, compute) * 1e6


def _time_ways(rows: int, n: int, k: int, copies: int, iters: int) -> dict[str, float]:
    """Microseconds per call of each way of computing x @ Wᵀ, over `copies` distinct weights."""
    x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
    weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
               for _ in range(copies)]
    times = {"x @ W^T (F.linear)": bench_graphed_over(functools.partial(F.linear, x), weights,
                                                      iters)}
    transposed = [w.t().contiguous() for w in weights]
    del weights
    times["x @ W (W stored transposed)"] = bench_graphed_over(
        functools.partial(torch.matmul, x), transposed, iters)
    return times


def bench_gemm(iters: int, ceilings: DeviceCeilings) -> None:
    print(f"decode projections at W1's batch: {LAYERS} distinct bf16 weights per graph, "
          f"microseconds per call")
    for rows in ROWS:
        total: dict[str, float] = {}
        floor = 0.0
        for name, (n, k) in {**PROJECTIONS, "logits": (VOCAB, 1024)}.items():
            calls = 1 if name == "logits" else LAYERS  # per decode step, distinct weights
            times = _time_ways(rows, n, k, calls, iters)
            floor += floor_us(rows, n, k, ceilings) * calls
            for way, us in times.items():
                total[way] = total.get(way, 0.0) + us * calls
            print(f"  {rows} rows {name:12s} floor {floor_us(rows, n, k, ceilings):6.1f}: "
                  + ", ".join(f"{way} {us:6.1f}" for way, us in times.items()))
        print(f"  {rows} rows, a step's products: floor {floor / 1e3:.3f} ms; "
              + ", ".join(f"{way} {us / 1e3:.3f} ms" for way, us in total.items()))
