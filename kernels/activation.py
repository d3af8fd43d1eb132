"""SwiGLU gate: silu(x[:, :I]) * x[:, I:] for the fused gate/up projection output."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._common import FLOAT_DTYPES, cdiv, check, jit, require_triton, tl, use_triton


@jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor) -> None:
    check(x.dim() == 2 and x.shape[1] % 2 == 0, f"x must be [T, 2I], got {tuple(x.shape)}")
    check(x.dtype in FLOAT_DTYPES, f"unsupported dtype {x.dtype}")


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    require_triton()
    _check(x)
    check(x.stride(1) == 1, "x rows must be contiguous")
    inter = x.shape[1] // 2
    out = torch.empty(x.shape[0], inter, dtype=x.dtype, device=x.device)
    if x.shape[0] > 0 and inter > 0:
        block = 1024
        _silu_and_mul_kernel[(x.shape[0], cdiv(inter, block))](
            x, out, inter, x.stride(0), out.stride(0), BLOCK=block, num_warps=4
        )
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    _check(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)
