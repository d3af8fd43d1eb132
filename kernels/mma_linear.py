"""y = x @ W.T (+ b) on the tensor cores, for the tens to hundreds of rows of a decode step.

At ~150 rows a decode step's projections are small GEMMs: cuBLAS tiles them for throughput,
which leaves most SMs idle on the narrow outputs (o_proj, down_proj: 1,024 features) and pays
its ramp-up in every one of a step's ~110 launches. Here the grid is (row tiles, column
tiles, K splits) with the row tiles of one column tile next to each other, so they read that
column tile's weights from DRAM once and share it through L2. With K split, each program
writes a float32 partial, and the last program of a tile to arrive (counted with an atomic)
sums the partials, adds the bias and stores the result: one launch, no reduction kernel.
The tile counters live in a per-device workspace and are reset by the program that sums, so
the kernel can be captured in a CUDA graph and replayed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels._attn_common import dot_precision
from kernels._common import (
    cdiv,
    check,
    jit,
    launch_pdl,
    pdl_wait,
    require_triton,
    tl,
    use_pdl,
)
from kernels.skinny_linear import check_linear


@dataclass(frozen=True)
class MmaConfig:
    """One launch shape: tile sizes, K splits, warps and pipeline stages."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    split_k: int = 1
    warps: int = 4
    stages: int = 4


@dataclass
class SplitWorkspace:
    """Float32 partials [split, rows, features] and one arrival counter per output tile,
    zero between launches. Shared by every launch on a device's stream, one at a time."""

    partials: torch.Tensor
    counters: torch.Tensor

    @classmethod
    def create(cls, device: torch.device | str, partial_elements: int = 8 << 20,
               tiles: int = 16_384) -> SplitWorkspace:
        return cls(torch.empty(partial_elements, dtype=torch.float32, device=device),
                   torch.zeros(tiles, dtype=torch.int32, device=device))


@jit
def _mma_linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, count_ptr, M, N, K,
                       stride_x, stride_w, stride_o,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    # Rows and features past the edge read the last valid one; they are never stored.
    x_rows = x_ptr + tl.minimum(m, M - 1).to(tl.int64)[:, None] * stride_x
    w_cols = w_ptr + tl.minimum(n, N - 1).to(tl.int64)[None, :] * stride_w
    k_share = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = split * k_share
    k_end = tl.minimum(k_start + k_share, K)
    pdl_wait(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + kk
        if EVEN_K:
            a = tl.load(x_rows + k[None, :])
            b = tl.load(w_cols + k[:, None])
        else:
            a = tl.load(x_rows + k[None, :], mask=k[None, :] < K, other=0.0)
            b = tl.load(w_cols + k[:, None], mask=k[:, None] < K, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    out_mask = (m[:, None] < M) & (n[None, :] < N)
    out_ptrs = out_ptr + m[:, None].to(tl.int64) * stride_o + n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        rows = tl.num_programs(0) * BLOCK_M
        part = part_ptr + (m[:, None].to(tl.int64) * N + n[None, :])
        tl.store(part + split * rows * N, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is written before the arrival counts
        counter = count_ptr + pid_m * tl.num_programs(1) + pid_n
        if tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT_K - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for s in range(SPLIT_K):  # from L2: other SMs wrote them
                total += tl.load(part + s * rows * N, mask=out_mask, other=0.0,
                                 cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(counter, 0)


_workspaces: dict[torch.device, SplitWorkspace] = {}


def split_workspace(device: torch.device) -> SplitWorkspace:
    """The device's workspace, made on first use. The first use must not be inside a CUDA
    graph's capture (the runner's warm-up steps run before it captures)."""
    if device not in _workspaces:
        check(not torch.cuda.is_current_stream_capturing(),
              "mma_linear's split-K workspace must exist before a CUDA graph is captured")
        _workspaces[device] = SplitWorkspace.create(device)
    return _workspaces[device]


def mma_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      config: MmaConfig | None = None,
                      workspace: SplitWorkspace | None = None) -> torch.Tensor:
    require_triton()
    check_linear(x, weight, bias)
    check(x.stride(1) == 1 and weight.stride(1) == 1, "rows must be contiguous")
    m, (n, k) = x.shape[0], weight.shape
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    cfg = config or choose_config(m, n, k)
    grid = (cdiv(m, cfg.block_m), cdiv(n, cfg.block_n), cfg.split_k)
    part, counters = out, out  # unused without splits
    if cfg.split_k > 1:
        ws = workspace or split_workspace(x.device)
        check(grid[0] * cfg.block_m * n * cfg.split_k <= ws.partials.numel()
              and grid[0] * grid[1] <= ws.counters.numel(), "split-K workspace too small")
        part, counters = ws.partials, ws.counters
    pdl = use_pdl(x)
    _mma_linear_kernel[grid](
        x, weight, bias if bias is not None else weight, out, part, counters, m, n, k,
        x.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
        EVEN_K=k % cfg.block_k == 0,
        DOT_PRECISION=dot_precision(x.dtype), PDL=pdl,
        num_warps=cfg.warps, num_stages=cfg.stages, **launch_pdl(pdl))
    return out


def choose_config(m: int, n: int, k: int) -> MmaConfig:
    """Enough programs to cover the SMs: narrow outputs split K."""
    tiles = cdiv(m, 64) * cdiv(n, 64)
    split = 1
    while tiles * split * 2 <= 132 and k // (split * 2) >= 256:
        split *= 2
    return MmaConfig(split_k=split)


def mma_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                   ) -> torch.Tensor:
    return F.linear(x, weight, bias)
