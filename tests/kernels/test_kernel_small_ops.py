"""store_kv, RMSNorm, SwiGLU and rotary: Triton (interpreted on CPU) vs the references,
and the references vs Hugging Face transformers."""

from __future__ import annotations

import pytest
import torch

from kernels.activation import silu_and_mul, silu_and_mul_ref, silu_and_mul_triton
from kernels.rms_norm import (
    add_rms_norm,
    add_rms_norm_ref,
    add_rms_norm_triton,
    rms_norm,
    rms_norm_ref,
    rms_norm_triton,
)
from kernels.rotary import apply_rotary, apply_rotary_ref, apply_rotary_triton, build_rope_cache
from kernels.store_kv import store_kv, store_kv_ref, store_kv_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def randn(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_store_kv_triton_matches_ref(block_size, index_dtype):
    t, hkv, d, nblocks = 11, 3, 16, 16
    kv = randn(t, 2 * hkv + 1, d)  # k and v as strided views of one projection output
    k, v = kv[:, :hkv], kv[:, hkv : 2 * hkv]
    slots = torch.randperm(nblocks * block_size, generator=torch.Generator().manual_seed(1))[:t]
    slots[[0, 4, 7]] = -1
    slots = slots.to(index_dtype).to(DEVICE)
    caches = [torch.zeros(nblocks, block_size, hkv, d, device=DEVICE) for _ in range(4)]
    store_kv_triton(k, v, caches[0], caches[1], slots)
    store_kv_ref(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    flat = caches[2].view(-1, hkv, d)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat[s], k[i])
    assert int((flat.abs().sum((1, 2)) > 0).sum()) == t - 3  # -1 slots wrote nothing


def test_store_kv_dispatch_and_errors():
    k = randn(4, 2, 16)
    kc, vc = torch.zeros(2, 4, 2, 16, device=DEVICE), torch.zeros(2, 4, 2, 16, device=DEVICE)
    store_kv(k, k, kc, vc, torch.tensor([0, 5, -1, 7], device=DEVICE))
    assert torch.equal(kc.view(-1, 2, 16)[5], k[1])
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv_triton(k, k, kc, vc, torch.tensor([0, 1], device=DEVICE))
    with pytest.raises(ValueError, match="int32 or int64"):
        store_kv_ref(k, k, kc, vc, torch.zeros(4, device=DEVICE))
    with pytest.raises(ValueError, match="head_dim"):
        store_kv_ref(k[..., :8], k[..., :8], kc, vc, torch.zeros(4, dtype=torch.int32))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_rms_norm_triton_matches_ref(dtype, tol):
    x, r, w = randn(7, 48, dtype=dtype), randn(7, 48, dtype=dtype, seed=1), randn(48, dtype=dtype)
    torch.testing.assert_close(rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6),
                               atol=tol, rtol=tol)
    normed, summed = add_rms_norm_triton(x, r, w, 1e-6)
    want_normed, want_summed = add_rms_norm_ref(x, r, w, 1e-6)
    torch.testing.assert_close(summed, want_summed, atol=tol, rtol=tol)
    torch.testing.assert_close(normed, want_normed, atol=tol, rtol=tol)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), atol=tol, rtol=tol)
    torch.testing.assert_close(add_rms_norm(x, r, w, 1e-6)[0], want_normed, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_ref_matches_hf(dtype):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    hf = Qwen3RMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(64))
    x, r = torch.randn(5, 3, 64).to(dtype), torch.randn(5, 3, 64).to(dtype)
    with torch.no_grad():
        assert torch.equal(rms_norm_ref(x, hf.weight, 1e-6), hf(x))
        normed, summed = add_rms_norm_ref(x, r, hf.weight, 1e-6)
        assert torch.equal(summed, x + r) and torch.equal(normed, hf(x + r))


def test_rms_norm_rejects_bad_weight():
    with pytest.raises(ValueError, match="weight"):
        rms_norm_ref(torch.randn(2, 8), torch.randn(4), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm_ref(torch.randn(2, 8), torch.randn(3, 8), torch.randn(8), 1e-6)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 1e-3)])
def test_silu_and_mul_triton_matches_ref(dtype, tol):
    x = randn(5, 2 * 1100, dtype=dtype)  # two column blocks, ragged tail
    torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_ref(x), atol=tol, rtol=tol)
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), atol=tol, rtol=tol)
    with pytest.raises(ValueError, match=r"\[T, 2I\]"):
        silu_and_mul_ref(x[:, :-1])


def test_silu_and_mul_ref_matches_hf_mlp_gate():
    from transformers.activations import ACT2FN

    x = torch.randn(6, 64).to(torch.bfloat16)
    gate, up = x[:, :32], x[:, 32:]
    assert torch.equal(silu_and_mul_ref(x), ACT2FN["silu"](gate) * up)


LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def hf_rotary(q, k, positions, head_dim, theta, scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (
        LlamaRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    params = {"rope_type": "default", "rope_theta": theta}
    params.update(scaling or {})
    config = LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim,
                         max_position_embeddings=4096, rope_parameters=params)
    emb = LlamaRotaryEmbedding(config)
    cos, sin = emb(q, positions[None])
    # HF layout is [batch, heads, seq, dim].
    qh, kh = q.transpose(0, 1)[None], k.transpose(0, 1)[None]
    qo, ko = apply_rotary_pos_emb(qh, kh, cos, sin)
    return qo[0].transpose(0, 1), ko[0].transpose(0, 1)


@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING], ids=["default", "llama3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_ref_matches_hf(scaling, dtype):
    head_dim, theta = 64, 10000.0
    q, k = torch.randn(9, 4, head_dim).to(dtype), torch.randn(9, 2, head_dim).to(dtype)
    positions = torch.tensor([0, 1, 2, 3, 17, 100, 511, 1000, 3000])
    cos_sin = build_rope_cache(head_dim, 4096, theta, scaling, "cpu")
    got_q, got_k = apply_rotary_ref(q, k, positions, cos_sin)
    want_q, want_k = hf_rotary(q, k, positions, head_dim, theta, scaling)
    assert got_q.dtype == dtype
    torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=0)
    torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=0)
    if dtype == torch.bfloat16:  # same roundings as HF: bit-identical
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_llama3_scaling_changes_only_low_frequencies():
    plain = build_rope_cache(64, 8, 10000.0, None, "cpu")
    scaled = build_rope_cache(64, 8, 10000.0, LLAMA3_SCALING, "cpu")
    assert torch.equal(plain[:, :4], scaled[:, :4])  # high frequencies untouched
    assert not torch.equal(plain[:, 28:32], scaled[:, 28:32])
    with pytest.raises(ValueError, match="unsupported rope_scaling"):
        build_rope_cache(64, 8, 10000.0, {"rope_type": "yarn", "factor": 2.0}, "cpu")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_rotary_triton_matches_ref(dtype, tol):
    t, h, hkv, d = 6, 3, 1, 32
    qkv = randn(t, (h + 2 * hkv) * d, dtype=dtype)
    q, k = qkv[:, : h * d].view(t, h, d), qkv[:, h * d : (h + hkv) * d].view(t, hkv, d)
    positions = torch.tensor([5, 0, 99, 3, 3, 64], device=DEVICE)
    cos_sin = build_rope_cache(d, 128, 1e6, LLAMA3_SCALING, DEVICE)
    got = apply_rotary_triton(q, k, positions, cos_sin)
    want = apply_rotary_ref(q, k, positions, cos_sin)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=tol, rtol=tol)
    for g, w in zip(apply_rotary(q, k, positions, cos_sin), want):
        torch.testing.assert_close(g, w, atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="disagree on T"):
        apply_rotary_ref(q, k, positions[:3], cos_sin)
