"""Decode attention over keys per tile x splits, against the automatic choice, on a CUDA GPU.

The automatic choice (kernels/paged_decode_attention.py: `_tile`, `_choose_splits`) is a
rule of thumb; this sweep is the evidence for it. For both model shapes (Qwen3-0.6B: 16 q /
8 kv heads of 128; SmolLM2-135M: 9 / 3 of 64) and batches from W1's load down to one
sequence, every (tile, splits) pair runs from a CUDA graph of 28 calls with a block table
as wide as a 4,096-token context, as a decode step runs it. Printed: microseconds per call.

    python scripts/sweep_decode_attention.py [--iters 30]
    python scripts/sweep_decode_attention.py --shapes smollm2-135m --tiles 128,256
"""

from __future__ import annotations

import argparse
import functools
import random

import torch
from benchlib.cuda_timing import bench_graphed, make_cache

from kernels.paged_decode_attention import paged_decode_attention_triton

SHAPES = {"qwen3-0.6b": (16, 8, 128), "smollm2-135m": (9, 3, 64)}
CASES = ((190, 200, 2000), (153, 200, 2000), (100, 200, 2000), (64, 200, 2000),
         (32, 500, 1500), (16, 4000, 4200), (8, 500, 700), (1, 1024, 1152))
"""(sequences, shortest and longest context): W1's spread of contexts at falling load, a
few long contexts, and batch 1 at W4's context."""
TILES = (64, 128)
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)


def sweep(heads: tuple[int, int, int], batch: int, lo: int, hi: int, iters: int,
          tiles: tuple[int, ...] = TILES) -> None:
    h, hkv, d = heads
    rng = random.Random(0)
    lens = [rng.randint(lo, hi) for _ in range(batch)]
    k_cache, v_cache, table = make_cache(lens, 256, 16, hkv, d)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, h, d, dtype=torch.bfloat16, device="cuda")
    call = functools.partial(paged_decode_attention_triton, q, k_cache, v_cache, table,
                             seq_lens, d**-0.5)
    print(f"batch {batch}, context {lo}-{hi}: automatic {bench_graphed(call, iters):.1f} us",
          flush=True)
    for tile in tiles:
        times = [bench_graphed(functools.partial(call, num_splits=n, block_n=tile), iters)
                 for n in SPLITS]
        row = [f"{n}:{us:.1f}" for n, us in zip(SPLITS, times, strict=True)]
        print(f"  {tile:3d}-key tiles, splits:time " + " ".join(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--tiles", default=",".join(map(str, TILES)),
                        help="comma-separated keys per tile (powers of two >= 16)")
    args = parser.parse_args()
    shapes = args.shapes.split(",")
    tiles = tuple(int(t) for t in args.tiles.split(","))
    if unknown := set(shapes) - SHAPES.keys():
        parser.error(f"unknown --shapes {sorted(unknown)}")
    if not torch.cuda.is_available():
        raise SystemExit("sweep_decode_attention needs a CUDA GPU")
    print(torch.cuda.get_device_name())
    torch.manual_seed(0)
    for name in shapes:
        heads = SHAPES[name]
        print(f"== {name} shape: {heads[0]} q / {heads[1]} kv heads of {heads[2]}")
        for batch, lo, hi in CASES:
            sweep(heads, batch, lo, hi, args.iters, tiles)


if __name__ == "__main__":
    main()
