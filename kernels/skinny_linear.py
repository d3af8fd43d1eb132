"""y = x @ W.T (+ b) for a handful of rows: the decode GEMM at batch 1-4.

cuBLAS picks tiles for many rows; with one to four it leaves most of the GPU idle on some
shapes. This kernel gives each program four output features and streams their weight rows
once, so the time is the weight read plus a launch. Timed on an H200 inside a CUDA graph of 28
distinct weights, like a decode step's layers (`nanopipe bench kernels --only gemv`, bf16,
microseconds per call, cuBLAS / here): Qwen3-0.6B's o_proj 12.67 / 4.29 at one row and
8.37 / 5.21 at four, its down_proj 6.62 / 5.27 and its qkv_proj 5.19 / 4.60 at one row; on the
8B shape's larger weights cuBLAS was as fast or faster. `linear` uses the kernel only where it
won (see `use_skinny`), F.linear elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._common import (
    FLOAT_DTYPES,
    cdiv,
    check,
    jit,
    launch_pdl,
    next_pow2,
    pdl_wait,
    require_triton,
    tl,
    use_pdl,
    use_triton,
)
from kernels.activation import silu_and_mul

BLOCK_N = 4
MAX_BLOCK_K = 1024
_MAX_WEIGHT_ELEMENTS = 8 << 20


@jit
def weight_tile(w_ptr, n, k, N, K, stride_w):
    """Rows n, columns k of the [N, K] weight, in fp32 (zeros outside)."""
    return tl.load(w_ptr + n[:, None].to(tl.int64) * stride_w + k[None, :],
                   mask=(n[:, None] < N) & (k[None, :] < K), other=0.0).to(tl.float32)


@jit
def row_tile(ptr, m, k, M, K, stride):
    """Rows m, columns k of an [M, >= K] input, in its own dtype (zeros outside)."""
    return tl.load(ptr + m[:, None] * stride + k[None, :],
                   mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)


@jit
def store_tile(out_ptr, acc, m, n, M, N, stride_o):
    tl.store(out_ptr + m[:, None] * stride_o + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(m[:, None] < M) & (n[None, :] < N))


@jit
def _skinny_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_o,
                   HAS_BIAS: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    # No step writes a weight: the first tile is read before waiting for the kernel before.
    w = weight_tile(w_ptr, n, tl.arange(0, BLOCK_K), N, K, stride_w)
    pdl_wait(PDL)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = row_tile(x_ptr, m, k, M, K, stride_x)
        if GATED:  # x rows are [gate | up]: silu(gate) * up, rounded as silu_and_mul stores it
            gate = x.to(tl.float32)
            up = row_tile(x_ptr + K, m, k, M, K, stride_x).to(tl.float32)
            x = (gate * tl.sigmoid(gate) * up).to(x_ptr.dtype.element_ty)
        x = x.to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        w = weight_tile(w_ptr, n, k + BLOCK_K, N, K, stride_w)  # past K: masked, not read
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    store_tile(out_ptr, acc, m, n, M, N, stride_o)


def use_skinny(rows: int, out_features: int, in_features: int) -> bool:
    """Where the kernel beat cuBLAS on an H200 (bf16): one row of a weight up to 16 MB, or up to
    four rows of a projection that narrows (o_proj, down_proj)."""
    if rows < 1 or out_features * in_features > _MAX_WEIGHT_ELEMENTS:
        return False
    return rows == 1 or (rows <= 4 and in_features >= 2 * out_features)


def check_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    check(x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1],
          f"x [M, K] and weight [N, K] must agree, got {tuple(x.shape)} and {tuple(weight.shape)}")
    check(x.dtype in FLOAT_DTYPES and weight.dtype == x.dtype, "x and weight: one float dtype")
    check(bias is None or bias.shape == (weight.shape[0],), "bias must be [N]")


def skinny_linear_triton(x: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """`gated`: x is [M, 2K], gate and up side by side, and the product is taken with
    silu(gate) * up (silu_and_mul's result) without writing that out."""
    require_triton()
    check_linear(x[:, :weight.shape[1]] if gated else x, weight, bias)
    check(not gated or x.shape[1] == 2 * weight.shape[1], "gated x must be [M, 2K]")
    check(x.shape[0] <= 16, "the skinny kernel takes at most 16 rows")
    check(x.stride(1) == 1 and weight.stride(1) == 1, "rows must be contiguous")
    m, (n, k) = x.shape[0], weight.shape
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    warps, stages = launch_options(m, n, k)
    pdl = use_pdl(x)
    _skinny_kernel[(cdiv(n, BLOCK_N),)](
        x, weight, bias if bias is not None else weight, out, m, n, k, x.stride(0),
        weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, GATED=gated,
        BLOCK_M=next_pow2(m), BLOCK_N=BLOCK_N, BLOCK_K=min(MAX_BLOCK_K, next_pow2(k)),
        PDL=pdl, num_warps=warps, num_stages=stages, **launch_pdl(pdl))
    return out


def launch_options(m: int, n: int, k: int) -> tuple[int, int]:
    """(num_warps, num_stages). A narrowing projection has few programs (n / 4): more warps
    each keep its reads going."""
    narrowing = k >= 2 * n
    return (4 if narrowing else 1) if m == 1 else 2, 1 if narrowing else 2


def runs_skinny(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Whether linear(x, weight) takes the kernel (on the CPU a layer's weight may be None: it
    lives in oneDNN's layout there, gpu_workers.layers.cpu_linear)."""
    return (x.is_cuda and weight is not None and x.dim() == 2
            and use_skinny(x.shape[0], weight.shape[0], weight.shape[1])
            and use_triton(x, weight) and x.stride(1) == 1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """F.linear, with the skinny kernel for the few-row shapes where it is faster."""
    if runs_skinny(x, weight):
        return skinny_linear_triton(x, weight, bias)
    return F.linear(x, weight, bias)


def gated_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """linear(silu_and_mul(x), weight, bias): one kernel for a single row (a batch-1 decode
    step's down projection: 6.2 us against 1.8 + 5.3 on an H200), the two ops elsewhere; from
    two rows on, every program computing the gate for all rows costs more than the launch."""
    if x.shape[0] == 1 and runs_skinny(x, weight):
        return skinny_linear_triton(x, weight, bias, gated=True)
    return linear(silu_and_mul(x), weight, bias)
