"""Triton kernels against the torch references at the Qwen3-0.6B shape, bf16, on a GPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from kernels.paged_attention import paged_attention_ref, paged_attention_triton
from kernels.paged_decode_attention import (
    paged_decode_attention_ref,
    paged_decode_attention_triton,
)
from kernels.rms_norm import add_rms_norm_ref, add_rms_norm_triton
from kernels.rotary import apply_rotary_ref, apply_rotary_triton, build_rope_cache
from kernels.store_kv import store_kv_ref, store_kv_triton

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
H, HKV, D, BS = 16, 8, 128, 256
BF16 = dict(atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "q_lens,ctx_lens",
    [
        ([1000, 1, 37, 513], [0, 700, 300, 2000]),  # prefill, decode, extend, long prefix
        ([1] * 64, list(range(0, 6400, 100))),  # unified path on a decode batch
    ],
)
def test_paged_attention_real_shape(q_lens, ctx_lens, paged_case):
    case = paged_case(q_lens, ctx_lens, H, HKV, D, BS, dtype=torch.bfloat16, device="cuda")
    out = paged_attention_triton(**case)
    ref = paged_attention_ref(**case)
    torch.testing.assert_close(out, ref, **BF16)


@pytest.mark.parametrize("num_splits", [None, 1, 7])
@pytest.mark.parametrize("batch,lo,hi", [(256, 500, 700), (3, 20000, 33000)])
def test_paged_decode_real_shape(batch, lo, hi, num_splits, paged_case):
    gen = torch.Generator().manual_seed(batch)
    ctx = torch.randint(lo, hi, (batch,), generator=gen).tolist()
    case = paged_case([1] * batch, ctx, H, HKV, D, BS, dtype=torch.bfloat16, device="cuda")
    args = (case["q"], case["k_cache"], case["v_cache"], case["block_tables"],
            case["seq_lens_k"], case["scale"])
    out = paged_decode_attention_triton(*args, num_splits=num_splits)
    torch.testing.assert_close(out, paged_decode_attention_ref(*args), **BF16)


@pytest.mark.parametrize("num_splits", [None, 1, 5])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 4, 256)])
def test_paged_decode_other_head_dims(heads, kv_heads, head_dim, num_splits, paged_case):
    """The keys per tile follow the head dim (128 up to dim 128, 64 above, where 128-key
    K/V stages would not fit in shared memory): each size compiles and is exact."""
    ctx = torch.randint(200, 2000, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    case = paged_case([1] * len(ctx), ctx, heads, kv_heads, head_dim, BS, dtype=torch.bfloat16,
                      device="cuda")
    args = (case["q"], case["k_cache"], case["v_cache"], case["block_tables"],
            case["seq_lens_k"], case["scale"])
    out = paged_decode_attention_triton(*args, num_splits=num_splits)
    torch.testing.assert_close(out, paged_decode_attention_ref(*args), **BF16)


def test_small_ops_real_shape():
    dev, t = "cuda", 777
    x = torch.randn(t, 1024, device=dev, dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.randn(1024, device=dev, dtype=torch.bfloat16)
    for got, want in zip(add_rms_norm_triton(x, r, w, 1e-6), add_rms_norm_ref(x, r, w, 1e-6)):
        torch.testing.assert_close(got, want, **BF16)
    g = torch.randn(t, 2 * 3072, device=dev, dtype=torch.bfloat16)
    torch.testing.assert_close(silu_and_mul_triton(g), silu_and_mul_ref(g), **BF16)
    cos_sin = build_rope_cache(D, 40960, 1e6, None, dev)
    qkv = torch.randn(t, (H + 2 * HKV) * D, device=dev, dtype=torch.bfloat16)
    q = qkv[:, : H * D].view(t, H, D)
    k = qkv[:, H * D : (H + HKV) * D].view(t, HKV, D)
    pos = torch.randint(0, 40960, (t,), device=dev)
    for got, want in zip(apply_rotary_triton(q, k, pos, cos_sin),
                         apply_rotary_ref(q, k, pos, cos_sin)):
        torch.testing.assert_close(got, want, **BF16)
    kc = torch.zeros(64, BS, HKV, D, device=dev, dtype=torch.bfloat16)
    vc, kc2, vc2 = kc.clone(), kc.clone(), kc.clone()
    slots = torch.randperm(64 * BS, device=dev)[:t]
    slots[::5] = -1
    v = torch.randn_like(k)
    store_kv_triton(k, v, kc, vc, slots)
    store_kv_ref(k, v, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="needs flash-attn")
@pytest.mark.parametrize(
    "q_lens,ctx_lens",
    [
        ([1000, 1, 37, 513], [0, 700, 300, 2000]),  # mixed extend batch: varlen path
        ([1] * 64, list(range(0, 6400, 100))),  # decode batch: kvcache path
    ],
)
def test_flash_attn_backend_matches_reference(q_lens, ctx_lens, paged_case):
    """The flash-attn backend reads our paged cache layout and block tables correctly."""
    from gpu_workers.layers.attention import AttentionBatch, PagedAttention

    case = paged_case(q_lens, ctx_lens, H, HKV, D, BS, dtype=torch.bfloat16, device="cuda")
    tables = case["block_tables"].clamp(min=0)  # padding slots hold a real block, as in serving
    lens = case["seq_lens_k"]
    cu_k = torch.zeros(len(q_lens) + 1, dtype=torch.int32, device="cuda")
    cu_k[1:] = lens.cumsum(0)
    layer = PagedAttention(H, HKV, D, case["scale"], backend="flash_attn")
    layer.k_cache, layer.v_cache = case["k_cache"], case["v_cache"]
    batch = AttentionBatch(
        slot_mapping=torch.empty(0, dtype=torch.int32, device="cuda"), block_tables=tables,
        cu_seqlens_q=case["cu_seqlens_q"], seq_lens_k=lens, cu_seqlens_k=cu_k,
        max_seqlen_q=max(q_lens), max_seqlen_k=int(lens.max()),
        decode=all(n == 1 for n in q_lens),
    )
    out = layer._flash(case["q"], batch)
    torch.testing.assert_close(out, paged_attention_ref(**case), **BF16)
