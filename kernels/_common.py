"""Shared helpers: optional Triton import and small launch utilities.

Triton is optional so that the pure-torch references (the CPU path) import everywhere.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - CPU-only installs without Triton
    triton = None
    tl = None
    HAS_TRITON = False


def jit(fn):
    """`triton.jit` when Triton exists; otherwise the plain function (never launched)."""
    return triton.jit(fn) if HAS_TRITON else fn


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def use_triton(*tensors: torch.Tensor) -> bool:
    """Dispatch rule: Triton for CUDA tensors, the torch reference otherwise."""
    return HAS_TRITON and all(t.is_cuda for t in tensors)


def require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use the *_ref function instead")


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors must be on one device, got {devices}")


def check_index_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
