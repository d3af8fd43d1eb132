"""Block tables sent at the width a step needs, widened on the device to the width a kernel
was captured with.

A CUDA graph's attention reads its block tables at a row stride fixed when it was captured,
as wide as the longest sequence allowed. A step's longest context usually needs a few of
those columns, so the host sends its tables compact, `width` columns a row, with `width` in
device memory; this kernel, the first node of the graph, copies each row's `width` columns
into the wide table. The columns past `width` keep older values that no kernel reads: every
reader stops at its sequence's length, which `width` covers. Its grid is one program per row
and its loop runs over `width`, so its cost follows the step's contexts, not the limit.
"""

from __future__ import annotations

import torch

from kernels._common import check, jit, require_triton, tl, use_triton

TILE = 64


@jit
def _widen_kernel(compact_ptr, width_ptr, wide_ptr, stride_wide, TILE: tl.constexpr):
    row = tl.program_id(0)
    width = tl.load(width_ptr)
    cols = tl.arange(0, TILE)
    src = compact_ptr + row.to(tl.int64) * width
    dst = wide_ptr + row.to(tl.int64) * stride_wide
    for c in range(0, width, TILE):
        ok = c + cols < width
        tl.store(dst + c + cols, tl.load(src + c + cols, mask=ok), mask=ok)


def _check(compact: torch.Tensor, width: torch.Tensor, wide: torch.Tensor) -> None:
    check(wide.dim() == 2 and wide.stride(1) == 1, "wide must be [rows, max_width], rows dense")
    check(compact.dim() == 1, "compact must be flat")
    check(width.numel() >= 1, "width must hold one value")
    check(compact.dtype == wide.dtype == width.dtype == torch.int32, "int32 tensors only")


def widen_tables_triton(compact: torch.Tensor, width: torch.Tensor, wide: torch.Tensor) -> None:
    require_triton()
    _check(compact, width, wide)
    if wide.shape[0]:
        _widen_kernel[(wide.shape[0],)](compact, width, wide, wide.stride(0), TILE=TILE,
                                        num_warps=1)


def widen_tables_ref(compact: torch.Tensor, width: torch.Tensor, wide: torch.Tensor) -> None:
    _check(compact, width, wide)
    w = int(width[0])
    check(0 <= w <= wide.shape[1], f"width {w} outside [0, {wide.shape[1]}]")
    rows = wide.shape[0]
    wide[:, :w] = compact[:rows * w].view(rows, w)


def widen_tables(compact: torch.Tensor, width: torch.Tensor, wide: torch.Tensor) -> None:
    """wide[r, :w] = compact[r * w:(r + 1) * w] for every row r of wide, w = width[0] (read
    on the device by the Triton kernel: CUDA-graph safe)."""
    if use_triton(compact, width, wide):
        widen_tables_triton(compact, width, wide)
    else:
        widen_tables_ref(compact, width, wide)
