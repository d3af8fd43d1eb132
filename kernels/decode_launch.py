"""How a decode attention launch is shaped (kernels.paged_decode_attention): keys per tile,
warps and pipeline stages, the grid's order and the split count. Each choice comes from a
sweep on the GPUs named in its docstring; a benchmark overrides them through the kernel's
arguments or by replacing these functions."""

from __future__ import annotations

import functools

import torch

from kernels._common import cdiv, next_pow2

MAX_SPLITS = 64


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def tile(q: torch.Tensor) -> int:
    """BLOCK_N: keys per tile, the unit a split is made of. On an H200, 128-key tiles beat
    64 by 3-4% at W1's load on head dim 128 and by ~20% on head dim 64 (a 64-wide tile
    moves too few bytes per loop step); above head dim 128 the staged K/V tiles would not fit
    in shared memory, so the tile halves (a sweep of tiles and splits on an H200)."""
    if not q.is_cuda:
        return 16
    return 128 if q.shape[-1] <= 128 else 64


def launch_config(q: torch.Tensor, group: int, split: bool,
                  fp8: bool = False) -> tuple[int, int, int]:
    """(num_warps, num_stages, ROWS); ROWS >= 16 feeds tl.dot on the GPU. Four warps with or
    without splits: with 128-key tiles two warps fall behind the loads. An fp8 cache with
    64-wide heads stages two tiles (fp8_decode_64)."""
    if q.is_cuda:
        stages = 2 if fp8_decode_64(q, fp8) else 3 if split else 4
        return 4, stages, max(16, next_pow2(group))
    return 4, 1, next_pow2(group)


def heads_first(head_dim: int) -> bool:
    """Launch a sequence's kv heads side by side (they read neighbouring bytes of each key)
    rather than one head of neighbouring sequences: 2% less time for 128-wide heads at 64-153
    sequences on an H100, bf16 and fp8 caches alike; mixed (-2% to +5%) for 64-wide ones."""
    return head_dim >= 128


def fp8_decode_64(q: torch.Tensor, fp8: bool) -> bool:
    """An fp8 cache with 64-wide heads (SmolLM2's): two staged tiles and eight waves of
    programs took 42.5-43.3 us against 48.1 at 153 sequences of 200-2,000 tokens and 21.8
    against 23.2 at 64 (H100, 2026-12-05); a 128-wide head's fp8 kernel moved by none of it."""
    return fp8 and q.shape[-1] <= 64


def choose_splits(q: torch.Tensor, num_seqs: int, num_kv_heads: int, max_len: int,
                  block_n: int, fp8: bool = False) -> int:
    """Enough (seq, kv head, split) programs to fill the GPU four times over (twice for 64-wide
    heads, whose merge costs relatively more: docs/benchmarks.md; eight times for them over
    an fp8 cache: fp8_decode_64), no more than the longest context has tiles. A few sequences
    thus get one tile per program: one tile's latency."""
    if not q.is_cuda:
        return 1
    waves = 8 if fp8_decode_64(q, fp8) else 2 if q.shape[-1] <= 64 else 4
    want = cdiv(waves * num_sms(q.device.index or 0), max(num_seqs * num_kv_heads, 1))
    return max(1, min(want, cdiv(max_len, block_n), MAX_SPLITS))
