"""The fp8 KV cache in the kernels: stores quantize (x / scale, saturated to +-448) and the
prefill and decode attention kernels read fp8 * scale, against the torch references.

The Triton interpreter (3.9) runs float8_e4m3fn, but its float -> fp8 cast rounds a value
that carries into the next power of two wrongly (31.6 becomes 16, not 32). So on the CPU the
store kernels are given values that fp8 holds exactly (the scale, the saturation and the slot
addressing are what is tested); the `gpu` tests compare arbitrary values. Reading fp8 is
exact in the interpreter, so the attention kernels are compared on any values everywhere.
"""

from __future__ import annotations

import pytest
import torch

from kernels.kv_quant import FP8_KV_DTYPE, FP8_MAX, dequantize, quantize
from kernels.paged_attention import paged_attention_ref, paged_attention_triton
from kernels.paged_decode_attention import (
    paged_decode_attention_ref,
    paged_decode_attention_triton,
)
from kernels.qk_norm_rope_store import qk_norm_rope_store_ref, qk_norm_rope_store_triton
from kernels.rotary import build_rope_cache
from kernels.store_kv import store_kv_ref, store_kv_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = dict(atol=1e-4, rtol=1e-4) if DEVICE == "cpu" else dict(atol=2e-2, rtol=2e-2)
SCALES = [(1.0, 1.0), (0.5, 4.0)]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _fp8_exact(shape: tuple[int, ...], scale: float, seed: int) -> torch.Tensor:
    """Values x with x / scale an fp8 value (scales are powers of two), some past +-448."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 40).to(FP8_KV_DTYPE).float() * scale
    x.view(-1)[::7] = 5000.0 * scale  # saturates to 448
    x.view(-1)[3::11] = -1e6 * scale
    return x


def _fp8_cache(shape, device=DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.zeros(shape, dtype=FP8_KV_DTYPE, device=device),
            torch.zeros(shape, dtype=FP8_KV_DTYPE, device=device))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).cpu()


@pytest.mark.parametrize("k_scale, v_scale", SCALES)
def test_store_kv_triton_writes_the_references_bytes(k_scale, v_scale):
    t, hkv, d, blocks, bs = 6, 2, 16, 5, 4
    k = _fp8_exact((t, hkv, d), k_scale, 0).to(DEVICE)
    v = _fp8_exact((t, hkv, d), v_scale, 1).to(DEVICE)
    slots = torch.tensor([0, 7, -1, 19, 4, 12], dtype=torch.int32, device=DEVICE)
    outs = []
    for store in (store_kv_triton, store_kv_ref):
        kc, vc = _fp8_cache((blocks, bs, hkv, d))
        store(k, v, kc, vc, slots, k_scale, v_scale)
        outs.append((kc, vc))
    (kt, vt), (kr, vr) = outs
    assert torch.equal(_bytes(kt), _bytes(kr)) and torch.equal(_bytes(vt), _bytes(vr))
    assert not kr.float().isnan().any() and kr.float().abs().max() == FP8_MAX
    # What attention reads back is the input (within fp8 saturation), slot by slot.
    back = dequantize(kr.view(-1, hkv, d)[slots[slots >= 0].long()], k_scale, torch.float32)
    want = k[slots >= 0].clamp(-FP8_MAX * k_scale, FP8_MAX * k_scale)
    torch.testing.assert_close(back, want.float(), atol=0, rtol=0)
    assert torch.equal(_bytes(kr.view(-1, hkv, d)[2]), torch.zeros(hkv, d, dtype=torch.uint8))


def test_quantize_rounds_to_nearest_and_saturates():
    x = torch.tensor([31.6, 0.3, -447.0, 460.0, 1e9, -float("inf"), 1e-9])
    q = quantize(x, 1.0, FP8_KV_DTYPE)
    assert q.float().tolist() == pytest.approx([32.0, 0.3125, -448.0, 448.0, 448.0, -448.0, 0.0])
    # e4m3 keeps 3 mantissa bits: a value in the normal range is within 1/16 of itself.
    y = torch.randn(4096) * 10
    err = (dequantize(quantize(y, 0.25, FP8_KV_DTYPE), 0.25, torch.float32) - y).abs()
    assert (err <= y.abs() / 16 + 2**-9 * 0.25).all()
    # A model-dtype cache ignores the scale.
    assert torch.equal(quantize(y, 0.25, torch.float32), y)


def _quantized_case(case: dict, k_scale: float, v_scale: float) -> dict:
    return {**case, "k_cache": quantize(case["k_cache"], k_scale, FP8_KV_DTYPE),
            "v_cache": quantize(case["v_cache"], v_scale, FP8_KV_DTYPE),
            "k_scale": k_scale, "v_scale": v_scale}


def _dequantized(case: dict) -> dict:
    """The same case over a float32 cache holding what the fp8 one means."""
    q = {k: v for k, v in case.items() if k not in ("k_scale", "v_scale")}
    q["k_cache"] = dequantize(case["k_cache"], case["k_scale"], torch.float32)
    q["v_cache"] = dequantize(case["v_cache"], case["v_scale"], torch.float32)
    return q


@pytest.mark.parametrize("k_scale, v_scale", SCALES)
@pytest.mark.parametrize("q_lens, ctx_lens", [([7, 20], [0, 0]), ([5, 1, 17, 3], [0, 9, 3, 30])])
def test_paged_attention_reads_fp8_as_fp8_times_scale(paged_case, dense_attention, q_lens,
                                                      ctx_lens, k_scale, v_scale):
    case = _quantized_case(paged_case(q_lens, ctx_lens, 4, 2, 16, 4), k_scale, v_scale)
    ref = paged_attention_ref(**case)
    torch.testing.assert_close(paged_attention_triton(**case), ref, **TOL)
    plain = _dequantized(case)
    torch.testing.assert_close(ref, paged_attention_ref(**plain), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ref.double().cpu(), dense_attention(plain), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("k_scale, v_scale", SCALES)
@pytest.mark.parametrize("num_splits, q_per_seq", [(1, 1), (3, 1), (1, 2), (2, 3)])
def test_paged_decode_attention_reads_fp8_as_fp8_times_scale(paged_case, k_scale, v_scale,
                                                             num_splits, q_per_seq):
    lens = [9, 40, 23]
    case = paged_case([q_per_seq] * 3, [n - q_per_seq for n in lens], 8, 2, 16, 4)
    case = _quantized_case(case, k_scale, v_scale)
    args = {k: v for k, v in case.items() if k != "cu_seqlens_q"}
    ref = paged_decode_attention_ref(**args, q_per_seq=q_per_seq)
    out = paged_decode_attention_triton(**args, num_splits=num_splits, q_per_seq=q_per_seq)
    torch.testing.assert_close(out, ref, **TOL)
    plain = {k: v for k, v in _dequantized(case).items() if k != "cu_seqlens_q"}
    torch.testing.assert_close(ref, paged_decode_attention_ref(**plain, q_per_seq=q_per_seq),
                               atol=1e-6, rtol=1e-6)


def test_an_fp8_cache_needs_queries_of_a_float_dtype(paged_case):
    case = _quantized_case(paged_case([3], [0], 4, 2, 16, 4), 1.0, 1.0)
    case["k_cache"] = case["k_cache"].float()
    with pytest.raises(ValueError, match="dtypes differ"):
        paged_attention_ref(**case)


# ---------------------------------------------------------------- on a GPU: any values


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_store_kv_fp8_matches_the_reference_on_any_values(dtype):
    gen = torch.Generator().manual_seed(3)
    t, hkv, d = 300, 8, 128
    k = (torch.randn(t, hkv, d, generator=gen) * 200).to(dtype).cuda()
    v = (torch.randn(t, hkv, d, generator=gen) * 3).to(dtype).cuda()
    slots = torch.randperm(64 * 16, generator=gen)[:t].to(torch.int32).cuda()
    slots[::17] = -1
    outs = []
    for store in (store_kv_triton, store_kv_ref):
        kc, vc = _fp8_cache((64, 16, hkv, d))
        store(k, v, kc, vc, slots, 0.37, 0.02)
        outs.append((_bytes(kc), _bytes(vc)))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("qk_norm", [False, True])
def test_gpu_qk_norm_rope_store_fp8_matches_the_reference(qk_norm):
    gen = torch.Generator().manual_seed(4)
    t, h, hkv, d = 70, 16, 4, 128
    qkv = (torch.randn(t, (h + 2 * hkv) * d, generator=gen) * 30).to(torch.bfloat16).cuda()
    positions = torch.randint(0, 500, (t,), generator=gen).cuda()
    cos_sin = build_rope_cache(d, 512, 10000.0, None, "cuda")
    w = [torch.rand(d, generator=gen).to(torch.bfloat16).cuda() + 0.5 for _ in range(2)]
    qw, kw = (w[0], w[1]) if qk_norm else (None, None)
    slots = torch.randperm(32 * 16, generator=gen)[:t].to(torch.int32).cuda()
    outs = []
    for fn in (qk_norm_rope_store_triton, qk_norm_rope_store_ref):
        kc, vc = _fp8_cache((32, 16, hkv, d))
        q = fn(qkv, h, hkv, positions, cos_sin, qw, kw, 1e-6, kc, vc, slots, 0.05, 0.1)
        outs.append((q, kc, vc))
    (qt, kt, vt), (qr, kr, vr) = outs
    # q and k come from the rotary, which the kernel computes in float32 and the reference
    # in bf16 products, as transformers does: where x1*cos and x2*sin nearly cancel, the two
    # differ by an ulp of the products, not of the result. So q gets the bf16 tolerance of
    # the unquantized fused test scaled with the inputs (x30 without the norm), and k the
    # same in the model's units (stored value * k_scale) or one fp8 step (3 mantissa bits:
    # 1/8 of the value), whichever is larger.
    atol = 2e-2 * (1 if qk_norm else 30)
    torch.testing.assert_close(qt, qr, atol=atol, rtol=2e-2)
    torch.testing.assert_close(kt.float() * 0.05, kr.float() * 0.05, atol=atol, rtol=0.13)
    # v is only divided by v_scale: within one fp8 step (or the subnormal step 2**-9), as
    # the kernel's fp32 division is not IEEE-exact and a value near the middle of two fp8
    # steps may round the other way.
    torch.testing.assert_close(vt.float(), vr.float(), atol=2.0**-9, rtol=0.13)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_attention_over_an_fp8_cache_matches_the_reference(paged_case, dtype):
    case = paged_case([130, 1, 37], [0, 300, 90], 16, 4, 128, 16, dtype=dtype)
    case = _quantized_case(case, 0.7, 1.3)
    tol = dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(paged_attention_triton(**case), paged_attention_ref(**case), **tol)
    dec = paged_case([1] * 5, [0, 17, 255, 1000, 64], 16, 4, 128, 16, dtype=dtype)
    dec = {k: v for k, v in _quantized_case(dec, 0.7, 1.3).items() if k != "cu_seqlens_q"}
    torch.testing.assert_close(paged_decode_attention_triton(**dec),
                               paged_decode_attention_ref(**dec), **tol)


@pytest.mark.parametrize("kernel", ["prefill", "decode"])
def test_bfloat16_queries_over_fp8_compute_in_float16_without_overflow(paged_case, kernel):
    """bf16 queries over an fp8 cache run in float16 (one instruction widens an e4m3 pair);
    a query past float16's range is clamped to it, never turned into inf or NaN."""
    case = paged_case([3, 1, 2], [20, 9, 30], 8, 2, 16, 4, dtype=torch.bfloat16)
    case = _quantized_case(case, 0.5, 2.0)
    case["q"][0, 0, 0] = 1e6  # bf16 holds it, float16 does not
    if kernel == "decode":
        case = paged_case([1] * 3, [20, 9, 30], 8, 2, 16, 4, dtype=torch.bfloat16)
        case = {k: v for k, v in _quantized_case(case, 0.5, 2.0).items()
                if k != "cu_seqlens_q"}
        case["q"][1, 0, 0] = -1e6
        out, ref = paged_decode_attention_triton(**case), paged_decode_attention_ref(**case)
    else:
        out, ref = paged_attention_triton(**case), paged_attention_ref(**case)
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)
