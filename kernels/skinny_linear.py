"""y = x @ W.T (+ b) for a handful of rows: the decode GEMM at batch 1-4.

cuBLAS picks tiles for many rows; with one to four it leaves most of the GPU idle on some
shapes (on an H200, Qwen3-0.6B's o_proj at one row: 12.5 us against 3.7 us here, the weight
read alone being 1 us). This kernel gives each program a few output features and streams their
weight rows once, so the time is the weight read plus a launch. `linear` uses it only where it
was measured to win (see `use_skinny`) and F.linear everywhere else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._common import (
    FLOAT_DTYPES,
    cdiv,
    check,
    jit,
    next_pow2,
    require_triton,
    tl,
    use_triton,
)

_BLOCK_K = 512


@jit
def _skinny_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_o,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_w + k[None, :],
                    mask=(n[:, None] < N) & (k[None, :] < K), other=0.0).to(tl.float32)
        x = tl.load(x_ptr + m[:, None] * stride_x + k[None, :],
                    mask=(m[:, None] < M) & (k[None, :] < K), other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m[:, None] * stride_o + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(m[:, None] < M) & (n[None, :] < N))


def use_skinny(rows: int, out_features: int, in_features: int) -> bool:
    """Where the kernel beat cuBLAS on an H200 (bf16): one row with up to 16k outputs, or up to
    four rows of a projection that narrows (o_proj, down_proj)."""
    return 0 < rows and ((rows == 1 and out_features <= 16384)
                         or (rows <= 4 and in_features >= 2 * out_features))


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    check(x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1],
          f"x [M, K] and weight [N, K] must agree, got {tuple(x.shape)} and {tuple(weight.shape)}")
    check(x.dtype in FLOAT_DTYPES and weight.dtype == x.dtype, "x and weight: one float dtype")
    check(bias is None or bias.shape == (weight.shape[0],), "bias must be [N]")


def skinny_linear_triton(x: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    require_triton()
    _check(x, weight, bias)
    check(x.shape[0] <= 16, "the skinny kernel takes at most 16 rows")
    check(x.stride(1) == 1 and weight.stride(1) == 1, "rows must be contiguous")
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    block_n = 8 if (m == 1 and n >= 4096) else 2
    _skinny_kernel[(cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out, m, n, k, x.stride(0),
        weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=next_pow2(m),
        BLOCK_N=block_n, BLOCK_K=_BLOCK_K, num_warps=1)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """F.linear, with the skinny kernel for the few-row shapes where it is faster."""
    if (x.dim() == 2 and use_skinny(x.shape[0], weight.shape[0], weight.shape[1])
            and use_triton(x, weight) and x.stride(1) == 1):
        return skinny_linear_triton(x, weight, bias)
    return F.linear(x, weight, bias)
