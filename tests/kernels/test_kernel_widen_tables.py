"""The widening kernel (interpreted on the CPU): each row's first `width` columns, read from
a compact table whose row stride is `width` (a value in device memory), land in the wide
table; its other columns are left as they were."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE

from kernels.widen_tables import widen_tables_ref, widen_tables_triton


@pytest.mark.parametrize("width", [0, 1, 5, 64, 70])
def test_widen_triton_matches_ref(width):
    rows, max_width = 3, 80
    compact = torch.arange(1, 1 + rows * width + 7, dtype=torch.int32, device=DEVICE)
    w = torch.tensor([width], dtype=torch.int32, device=DEVICE)
    got = torch.full((rows, max_width), -1, dtype=torch.int32, device=DEVICE)
    want = got.clone()
    widen_tables_triton(compact, w, got)
    widen_tables_ref(compact, w, want)
    assert torch.equal(got, want)
    assert bool((got[:, width:] == -1).all())
