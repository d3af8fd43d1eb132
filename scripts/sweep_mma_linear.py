"""The tensor-core linear kernel's launch shapes against cuBLAS at decode's batch sizes (CUDA).

For each projection of a model shape (Qwen3-0.6B, SmolLM2-135M) and each row count, every
launch shape of a grid (rows and features per tile, keys per step, K splits, pipeline stages)
runs from a CUDA graph over one distinct weight per layer, as a decode step runs them, and so
does F.linear (cuBLAS). Printed per case: cuBLAS, the kernel's automatic choice and the
grid's best, in microseconds per call, each checked against F.linear; then, per row count, a
step's total over all layers.

    python scripts/sweep_mma_linear.py [--shapes qwen3-0.6b,smollm2-135m] [--rows 32,160,192]
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch
import torch.nn.functional as F
from benchlib.cuda_timing import bench

from kernels.mma_linear import MmaConfig, mma_linear_triton

SHAPES = {
    "qwen3-0.6b": (28, {"qkv_proj": (4096, 1024), "o_proj": (1024, 2048),
                        "gate_up_proj": (6144, 1024), "down_proj": (1024, 3072)}),
    "smollm2-135m": (30, {"qkv_proj": (960, 576), "o_proj": (576, 576),
                          "gate_up_proj": (3072, 576), "down_proj": (576, 1536)}),
}
ROWS = (16, 32, 64, 96, 128, 160, 192, 256)


def grid(rows: int, k: int) -> list[MmaConfig]:
    block_ms = [b for b in (16, 32, 64, 128) if b <= max(16, 2 * rows) and (b >= 64 or rows <= 64)]
    splits = [s for s in (1, 2, 4, 8) if k // s >= 256]
    return [MmaConfig(bm, bn, bk, s, 8 if bm * bn >= 128 * 128 else 4, 4 if bk == 64 else 3)
            for bm, bn, bk, s in itertools.product(block_ms, (32, 64, 128), (64, 128), splits)]


def graphed(fn, weights: list[torch.Tensor], iters: int) -> float:
    """Microseconds per call of fn(w), one call per weight in one CUDA graph."""
    fn(weights[0])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(w)
    return bench(graph.replay, iters) * 1e3 / len(weights)


def error(cfg: MmaConfig | None, x: torch.Tensor, w: torch.Tensor) -> float:
    """Largest difference to F.linear, after a graph replayed twice (the counters reset)."""
    out = mma_linear_triton(x, w, config=cfg)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mma_linear_triton(x, w, config=cfg)
    graph.replay()
    graph.replay()
    return float((out.float() - F.linear(x, w).float()).abs().max())


def sweep_case(n: int, k: int, rows: int, layers: int, iters: int) -> tuple[float, float, float]:
    weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
               for _ in range(layers)]
    x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
    cublas = graphed(functools.partial(F.linear, x), weights, iters)
    auto = graphed(functools.partial(mma_linear_triton, x), weights, iters)
    timed = []
    for cfg in grid(rows, k):
        try:
            timed.append((graphed(lambda w, c=cfg: mma_linear_triton(x, w, config=c),
                                  weights, iters), cfg))
        except Exception as exc:  # a shape the compiler refuses (shared memory): skip it
            print(f"    skipped {cfg}: {type(exc).__name__}")
    best_us, best = min(timed, key=lambda t: t[0])
    ref_scale = float(F.linear(x, weights[0]).float().abs().max())
    print(f"  {rows:3d} rows: cuBLAS {cublas:6.2f}  auto {auto:6.2f} "
          f"(err {error(None, x, weights[0]) / ref_scale:.1e})  best {best_us:6.2f} "
          f"(err {error(best, x, weights[0]) / ref_scale:.1e}) {best}", flush=True)
    del weights
    return cublas, auto, best_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sweep_mma_linear needs a CUDA GPU")
    print(torch.cuda.get_device_name())
    torch.manual_seed(0)
    rows_list = [int(r) for r in args.rows.split(",")]
    for name in args.shapes.split(","):
        layers, projections = SHAPES[name]
        totals = {r: [0.0, 0.0, 0.0] for r in rows_list}
        for proj, (n, k) in projections.items():
            print(f"== {name} {proj}: {n} x {k}, {layers} weights per graph", flush=True)
            for rows in rows_list:
                for i, us in enumerate(sweep_case(n, k, rows, layers, args.iters)):
                    totals[rows][i] += us * layers
        for rows, (cublas, auto, best) in totals.items():
            print(f"{name} step at {rows} rows, all layers' projections: cuBLAS "
                  f"{cublas:.0f} us, auto {auto:.0f}, best {best:.0f}", flush=True)


if __name__ == "__main__":
    main()
