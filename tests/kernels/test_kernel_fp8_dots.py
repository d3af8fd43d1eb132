"""Decode attention over an fp8 cache with its dots on the tensor cores in e4m3 (`fp8_dots`):
1 takes the queries as e4m3, each row scaled to the format's range, for Q·Kᵀ; 2 also takes
the probabilities, scaled by 256, as e4m3 for P·V.

The Triton interpreter's float -> fp8 cast rounds some values wrongly (test_kernel_fp8_kv.py),
so on the CPU the queries are chosen so that each row's scaling makes them fp8 values exactly
and mode 1 must then match the reference; mode 2 casts probabilities, arbitrary values, and is
compared on a GPU only, within e4m3's precision.
"""

from __future__ import annotations

import pytest
import torch

from kernels.kv_quant import FP8_KV_DTYPE, FP8_MAX, quantize
from kernels.paged_decode_attention import (
    paged_decode_attention_ref,
    paged_decode_attention_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _decode_case(paged_case, lens: list[int], q_per_seq: int, heads=(8, 2, 16), bs=4) -> dict:
    h, hkv, d = heads
    case = paged_case([q_per_seq] * len(lens), [n - q_per_seq for n in lens], h, hkv, d, bs,
                      dtype=torch.bfloat16)
    case.pop("cu_seqlens_q")
    case["k_cache"] = quantize(case["k_cache"], 0.5, FP8_KV_DTYPE)
    case["v_cache"] = quantize(case["v_cache"], 2.0, FP8_KV_DTYPE)
    return {**case, "k_scale": 0.5, "v_scale": 2.0}


def _fp8_exact_rows(shape: tuple[int, ...]) -> torch.Tensor:
    """bf16 queries whose rows each scale to e4m3 values exactly: fp8 values over 64, with
    the largest, 448 / 64, in every row (its scale is then 1/64)."""
    gen = torch.Generator().manual_seed(5)
    q = (torch.randn(shape, generator=gen) * 40).to(FP8_KV_DTYPE).float()
    q[..., 0] = FP8_MAX
    return (q / 64).to(torch.bfloat16)


@pytest.mark.parametrize("num_splits, q_per_seq", [(1, 1), (3, 1), (2, 3)])
def test_fp8_query_dots_match_the_reference(paged_case, num_splits, q_per_seq):
    case = _decode_case(paged_case, [9, 40, 23], q_per_seq)
    case["q"] = _fp8_exact_rows(tuple(case["q"].shape)).to(DEVICE)
    ref = paged_decode_attention_ref(**case, q_per_seq=q_per_seq)
    out = paged_decode_attention_triton(**case, num_splits=num_splits, q_per_seq=q_per_seq,
                                        fp8_dots=1)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


def test_fp8_dots_need_an_fp8_cache_and_16_bit_queries(paged_case):
    case = _decode_case(paged_case, [9], 1)
    with pytest.raises(ValueError, match="fp8_dots is 0, 1 or 2"):
        paged_decode_attention_triton(**case, fp8_dots=3)
    plain = {**case, "k_cache": case["k_cache"].to(torch.bfloat16),
             "v_cache": case["v_cache"].to(torch.bfloat16)}
    with pytest.raises(ValueError, match="need an fp8 cache"):
        paged_decode_attention_triton(**plain, fp8_dots=1)
    with pytest.raises(ValueError, match="need an fp8 cache"):
        paged_decode_attention_triton(**{**case, "q": case["q"].float()}, fp8_dots=1)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fp8_dots", [1, 2])
def test_gpu_fp8_dots_stay_within_e4m3_precision(paged_case, fp8_dots):
    """Any queries: each score and (mode 2) each probability carries e4m3's rounding (3
    mantissa bits), so the outputs, averages of values of about 1, stay within a few 1e-2."""
    case = _decode_case(paged_case, [1, 17, 255, 1000, 64], 1, heads=(16, 8, 128), bs=16)
    ref = paged_decode_attention_ref(**case)
    out = paged_decode_attention_triton(**case, fp8_dots=fp8_dots)
    torch.testing.assert_close(out, ref, atol=1e-1, rtol=1e-1)
    assert (out.float() - ref.float()).abs().mean() < 1e-2
