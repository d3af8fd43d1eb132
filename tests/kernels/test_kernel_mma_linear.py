"""The tensor-core linear kernel (interpreted on CPU) against F.linear, with K split."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.mma_linear import MmaConfig, SplitWorkspace, mma_linear_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows,n,k,cfg,bias", [
    (37, 70, 96, MmaConfig(16, 16, 32, 1), True),
    (37, 70, 96, MmaConfig(16, 16, 32, 2), True),
    (5, 33, 200, MmaConfig(16, 32, 32, 3), False),  # K not a multiple of the tile
    (20, 64, 128, MmaConfig(16, 16, 32, 4), False)])
def test_matches_f_linear_and_leaves_the_counters_at_zero(rows, n, k, cfg, bias):
    gen = torch.Generator().manual_seed(rows + n + k)
    x = torch.randn(rows, k, generator=gen).to(DEVICE)
    w = torch.randn(n, k, generator=gen).to(DEVICE)
    b = torch.randn(n, generator=gen).to(DEVICE) if bias else None
    ws = SplitWorkspace.create(DEVICE, 1 << 16, 256)
    for _ in range(2):  # the second launch finds the counters the first one reset
        torch.testing.assert_close(mma_linear_triton(x, w, b, cfg, ws), F.linear(x, w, b),
                                   rtol=1e-4, atol=1e-4)
    assert int(ws.counters.abs().sum()) == 0
