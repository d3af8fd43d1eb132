"""float32 attention computes in float32: the kernels' dots are IEEE, not TF32.

Triton's default for float32 `tl.dot` on NVIDIA GPUs is TF32 (operands cut to 10-bit
mantissas, ~1e-3 relative error). The interpreter multiplies in full precision whatever the
kernel asks for, so on the CPU the fixture below makes it do what the GPU does: round the
float32 operands of a TF32 dot to TF32. On a GPU the tests run on the hardware itself.
Either way the float32 kernels must match a float64 reference to well under TF32's error.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from kernels.paged_attention import paged_attention_triton
from kernels.paged_decode_attention import paged_decode_attention_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# IEEE float32 lands near 1e-7 here; TF32 operands miss by ~1e-3.
FP32_TOL = dict(atol=2e-5, rtol=2e-5)


def _to_tf32(x: np.ndarray) -> np.ndarray:
    """Round float32 values to TF32 (10 mantissa bits), nearest with ties away from zero."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


@pytest.fixture(autouse=True)
def gpu_like_dots(monkeypatch):
    """Under the interpreter, TF32 dots of float32 operands round them as NVIDIA GPUs do."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    from triton._C.libtriton import ir
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    exact_dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if input_precision == ir.INPUT_PRECISION.TF32 and a.data.dtype == np.float32:
            a = interpreter.TensorHandle(_to_tf32(a.data), a.dtype)
            b = interpreter.TensorHandle(_to_tf32(b.data), b.dtype)
        return exact_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(builder, "create_dot", create_dot)
    yield


@triton.jit
def _default_dot_kernel(a_ptr, b_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    a = tl.load(a_ptr + i[:, None] * N + i[None, :])
    b = tl.load(b_ptr + i[:, None] * N + i[None, :])
    tl.store(out_ptr + i[:, None] * N + i[None, :], tl.dot(a, b))


def _cpu(case: dict) -> dict:
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in case.items()}


def test_a_default_float32_dot_is_tf32_here():
    """The check has teeth: a dot left at Triton's default misses float64 by TF32's error."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(32, 32, generator=gen).to(DEVICE) for _ in range(2))
    out = torch.empty_like(a)
    _default_dot_kernel[(1,)](a, b, out, N=32)
    err = (out.double() - a.double() @ b.double()).abs().max().item()
    assert err > 1e-3, f"default float32 dot missed float64 by only {err:.1e}"


@pytest.mark.parametrize("q_lens,ctx_lens", [([9, 20], [0, 0]), ([5, 1, 17], [12, 40, 3])])
def test_float32_paged_attention_matches_float64(q_lens, ctx_lens, paged_case, dense_attention):
    case = paged_case(q_lens, ctx_lens, 4, 2, 32, 4, device=DEVICE)
    out = paged_attention_triton(**case)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.cpu().double(), dense_attention(_cpu(case)), **FP32_TOL)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_float32_decode_attention_matches_float64(num_splits, paged_case, dense_attention):
    case = paged_case([1] * 4, [7, 40, 65, 0], 4, 2, 32, 4, device=DEVICE)
    out = paged_decode_attention_triton(
        case["q"], case["k_cache"], case["v_cache"], case["block_tables"], case["seq_lens_k"],
        case["scale"], num_splits=num_splits,
    )
    torch.testing.assert_close(out.cpu().double(), dense_attention(_cpu(case)), **FP32_TOL)
