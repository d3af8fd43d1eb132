"""RMSNorm fused into the skinny GEMV (interpreted on CPU) against rms_norm then F.linear:
with and without the residual add, one row and a few, K past one tile."""

from __future__ import annotations

import pytest
import torch

from kernels.norm_linear import norm_linear_ref, norm_linear_triton
from kernels.rms_norm import add_rms_norm_triton, rms_norm_triton
from kernels.skinny_linear import skinny_linear_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows,n,k", [(1, 37, 64), (3, 9, 1500), (4, 130, 256)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_equals_the_norm_kernel_then_the_gemv(rows, n, k, with_residual):
    gen = torch.Generator().manual_seed(rows * 10 + k)
    x = torch.randn(rows, k, generator=gen).to(DEVICE, torch.bfloat16)
    residual = torch.randn(rows, k, generator=gen).to(DEVICE, torch.bfloat16) \
        if with_residual else None
    norm_w = (1 + 0.1 * torch.randn(k, generator=gen)).to(DEVICE, torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(DEVICE, torch.bfloat16)
    if with_residual:
        h, s = add_rms_norm_triton(x, residual, norm_w, 1e-6)
    else:
        h, s = rms_norm_triton(x, norm_w, 1e-6), x
    expected = skinny_linear_triton(h, w)
    got, res_out = norm_linear_triton(x, residual, norm_w, 1e-6, w)
    torch.testing.assert_close(res_out, s, rtol=0, atol=0)  # the next residual, bitwise
    # The norm's sum of squares may add in another order: the output within bf16 rounding.
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
    ref, ref_s = norm_linear_ref(x.float(), None if residual is None else residual.float(),
                                 norm_w.float(), 1e-6, w.float())
    torch.testing.assert_close(got.float(), ref, rtol=5e-2, atol=5e-2)


def test_refuses_a_mismatched_norm_weight():
    x = torch.randn(1, 64).to(DEVICE)
    with pytest.raises(ValueError, match="norm weight"):
        norm_linear_triton(x, None, torch.ones(32).to(DEVICE), 1e-6, torch.randn(8, 64).to(DEVICE))
