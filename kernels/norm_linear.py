"""linear(rms_norm(x + residual)) in one kernel, for the few rows of a decode step.

At batch 1-4 each layer's two norms are kernels of their own that read and write a few KB: a
launch each, between the GEMVs that dominate the step. Here every program of the skinny GEMV
(kernels.skinny_linear) first computes the norm statistics of the rows itself — they are a few
KB, read from L2 — and normalises each tile of x as it streams its weight rows; program 0 also
writes x + residual, the next residual. The roundings are rms_norm's (kernels.rms_norm): the
sum rounded to the input dtype, the normalisation in fp32, cast back before the weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._common import (
    cdiv,
    check,
    jit,
    launch_pdl,
    next_pow2,
    pdl_wait,
    require_triton,
    tl,
    use_pdl,
)
from kernels.rms_norm import add_rms_norm_ref, rms_norm_ref
from kernels.skinny_linear import (
    BLOCK_N,
    MAX_BLOCK_K,
    check_linear,
    launch_options,
    row_tile,
    store_tile,
    weight_tile,
)


@jit
def _norm_linear_kernel(x_ptr, res_ptr, norm_w_ptr, w_ptr, out_ptr, res_out_ptr, M, N, K, eps,
                        stride_x, stride_r, stride_w, stride_o, stride_ro,
                        HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROW: tl.constexpr,
                        PDL: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    # No step writes a weight: the first tile is read before waiting for the kernel before.
    w = weight_tile(w_ptr, n, tl.arange(0, BLOCK_K), N, K, stride_w)
    pdl_wait(PDL)
    m = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, ROW)
    row_mask = (m[:, None] < M) & (cols[None, :] < K)
    s = row_tile(x_ptr, m, cols, M, K, stride_x)
    if HAS_RESIDUAL:
        r_row = row_tile(res_ptr, m, cols, M, K, stride_r)
        s = (s.to(tl.float32) + r_row.to(tl.float32)).to(x_ptr.dtype.element_ty)
        if pid == 0:
            tl.store(res_out_ptr + m[:, None] * stride_ro + cols[None, :], s, mask=row_mask)
    sf = s.to(tl.float32)
    inv = tl.rsqrt(tl.sum(sf * sf, axis=1) / K + eps)

    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = row_tile(x_ptr, m, k, M, K, stride_x)
        if HAS_RESIDUAL:
            r = row_tile(res_ptr, m, k, M, K, stride_r)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        y = (x.to(tl.float32) * inv[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
        g = tl.load(norm_w_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        x = (y * g[None, :]).to(x_ptr.dtype.element_ty).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        w = weight_tile(w_ptr, n, k + BLOCK_K, N, K, stride_w)  # past K: masked, not read
    store_tile(out_ptr, acc, m, n, M, N, stride_o)


def norm_linear_triton(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                       eps: float, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rms_norm(s), weight), s) with s = x + residual, or x where residual is None."""
    require_triton()
    check_linear(x, weight, None)
    check(norm_weight.shape == (x.shape[1],) and norm_weight.is_contiguous(),
          f"norm weight must be [{x.shape[1]}]")
    check(residual is None or (residual.shape == x.shape and residual.dtype == x.dtype),
          "residual must match x")
    check(x.stride(1) == 1 and weight.stride(1) == 1
          and (residual is None or residual.stride(1) == 1), "rows must be contiguous")
    m, (n, k) = x.shape[0], weight.shape
    check(m <= 16, "the kernel takes at most 16 rows")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    res_out = x if residual is None else torch.empty_like(x)
    if m == 0 or n == 0:
        return out, res_out
    res = x if residual is None else residual
    warps, stages = launch_options(m, n, k)
    pdl = use_pdl(x)
    _norm_linear_kernel[(cdiv(n, BLOCK_N),)](
        x, res, norm_weight, weight, out, res_out, m, n, k, eps, x.stride(0), res.stride(0),
        weight.stride(0), out.stride(0), res_out.stride(0), HAS_RESIDUAL=residual is not None,
        BLOCK_M=next_pow2(m), BLOCK_N=BLOCK_N, BLOCK_K=min(MAX_BLOCK_K, next_pow2(k)),
        ROW=next_pow2(k), PDL=pdl, num_warps=warps, num_stages=stages, **launch_pdl(pdl))
    return out, res_out


def norm_linear_ref(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                    eps: float, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is None:
        return F.linear(rms_norm_ref(x, norm_weight, eps), weight), x
    h, s = add_rms_norm_ref(x, residual, norm_weight, eps)
    return F.linear(h, weight), s
