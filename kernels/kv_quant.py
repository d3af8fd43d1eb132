"""The FP8 KV cache's number format: what a store writes and what attention reads back.

An fp8 cache holds x / scale as float8_e4m3fn, saturated to +-448 (the format's largest
finite value; a plain cast of anything larger gives NaN), and attention reads fp8 * scale.
The scale is one float32 per layer for K and one for V, 1.0 unless the checkpoint carries
it. A cache in the model's dtype ignores the scales: it stores and reads values as they are.
"""

from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_KV_DTYPE).max)  # 448.0


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_KV_DTYPE


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of `dtype` stores it."""
    if not is_fp8(dtype):
        return x.to(dtype)
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(dtype)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache values x as attention reads them, in `dtype` (the queries')."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


def raw(t: torch.Tensor) -> torch.Tensor:
    """t's bytes for copies: torch has no CPU index_copy_ for float8, and a copy of bytes is
    the same copy for every dtype of one byte."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t
