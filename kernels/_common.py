"""Shared helpers: optional Triton import and small launch utilities.

Triton is optional so that the pure-torch references (the CPU path) import everywhere.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - CPU-only installs without Triton
    triton = None
    tl = None
    HAS_TRITON = False


def jit(fn=None, **options):
    """`triton.jit` when Triton exists; otherwise the plain function (never launched).
    `@jit(do_not_specialize=...)` passes Triton's options on."""
    if fn is None:
        return lambda f: jit(f, **options)
    return triton.jit(fn, **options) if HAS_TRITON else fn


PDL_ENABLED = (os.environ.get("TRITON_INTERPRET") != "1"  # it cannot run the wait
               and hasattr(getattr(getattr(tl, "extra", None), "cuda", None), "gdc_wait"))
"""Programmatic dependent launch for the decode path's kernels (Triton 3.4 on)."""


@functools.cache
def _has_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def use_pdl(t: torch.Tensor) -> bool:
    """Whether a kernel on t's device launches before its predecessor ends (Hopper on).

    A decode step at batch 1 is ~200 short kernels in a row; with PDL each one is launched
    while the one before runs, reads its weights, and waits (`pdl_wait`) only before touching
    what the step computed. Every kernel launched this way must call `pdl_wait` in all its
    programs: the next kernel's wait covers only its direct predecessor.
    """
    return PDL_ENABLED and t.is_cuda and _has_pdl(t.device.index or 0)


def launch_pdl(on: bool) -> dict[str, bool]:
    """The launch option that goes with PDL=on; none without it (Triton before 3.4 knows no
    launch_pdl and refuses it even when False)."""
    return {"launch_pdl": True} if on else {}


@jit
def pdl_wait(PDL: tl.constexpr):
    """Waits for the kernels before this one (their writes visible), then lets the next
    kernel launch. A no-op without PDL (and in the interpreter, which never sets it)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


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
