"""The few-row linear kernel (interpreted on CPU) against F.linear, and where it is used."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.skinny_linear import skinny_linear_triton, use_skinny

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows,shape,bias", [
    (1, (37, 70), False), (3, (9, 600), True), (4, (37, 70), True), (1, (4100, 64), True),
    (1, (6, 1500), False), (2, (5, 2100), True)])  # K past one 1,024-wide tile, K % 1024 != 0
def test_matches_f_linear(rows, shape, bias):
    n, k = shape
    gen = torch.Generator().manual_seed(rows * 100 + n)
    x = torch.randn(rows, k, generator=gen).to(DEVICE)
    w = torch.randn(n, k, generator=gen).to(DEVICE)
    b = torch.randn(n, generator=gen).to(DEVICE) if bias else None
    got = skinny_linear_triton(x, w, b)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_a_strided_row_view_is_read_in_place():
    x = torch.randn(2, 200).to(DEVICE)[:, :100]
    w = torch.randn(8, 100).to(DEVICE)
    torch.testing.assert_close(skinny_linear_triton(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_used_only_where_it_wins():
    """The H200 timings of the module's docstring: Qwen3-0.6B's four projections at one row,
    its narrowing ones up to four rows; cuBLAS for the 8B shape's weights and the LM head."""
    assert all(use_skinny(1, n, k) for n, k in ((4096, 1024), (1024, 2048), (6144, 1024),
                                                  (1024, 3072)))
    assert use_skinny(4, 1024, 3072) and use_skinny(2, 1024, 2048)
    assert not use_skinny(1, 151936, 1024)  # the vocabulary projection: cuBLAS is as fast
    assert not use_skinny(1, 4096, 4096) and not use_skinny(1, 4096, 12288)  # 8B: cuBLAS
    assert not use_skinny(2, 6144, 1024) and not use_skinny(8, 1024, 2048)
    assert not use_skinny(0, 1024, 2048)


def test_mismatched_inputs_are_refused():
    with pytest.raises(ValueError, match="must agree"):
        skinny_linear_triton(torch.randn(1, 5).to(DEVICE), torch.randn(3, 6).to(DEVICE))


@pytest.mark.parametrize("rows,n,k", [(1, 37, 70), (3, 9, 1500)])
def test_gated_equals_silu_and_mul_then_linear(rows, n, k):
    """The down projection's fused input: bitwise what the two kernels give in bf16."""
    from kernels.activation import silu_and_mul_triton
    from kernels.skinny_linear import gated_linear

    gen = torch.Generator().manual_seed(rows + n)
    gate_up = torch.randn(rows, 2 * k, generator=gen).to(DEVICE, torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(DEVICE, torch.bfloat16)
    b = torch.randn(n, generator=gen).to(DEVICE, torch.bfloat16)
    expected = skinny_linear_triton(silu_and_mul_triton(gate_up), w, b)
    torch.testing.assert_close(skinny_linear_triton(gate_up, w, b, gated=True), expected,
                               rtol=0, atol=0)
    if DEVICE == "cuda":  # gated_linear picks the kernel only on a GPU
        torch.testing.assert_close(gated_linear(gate_up, w, b), expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"\[M, 2K\]"):
        skinny_linear_triton(gate_up[:, :-2], w, gated=True)
