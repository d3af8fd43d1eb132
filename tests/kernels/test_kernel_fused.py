"""The fused q/k-norm + rotary + KV-store kernel (interpreted on CPU) against its reference,
and the reference against the unfused ops it replaces in the decoder."""

from __future__ import annotations

import pytest
import torch

from kernels.qk_norm_rope_store import (
    qk_norm_rope_store,
    qk_norm_rope_store_ref,
    qk_norm_rope_store_triton,
)
from kernels.rms_norm import rms_norm_ref
from kernels.rotary import apply_rotary_ref, build_rope_cache
from kernels.store_kv import store_kv_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
BLOCK_SIZE, NUM_BLOCKS, EPS = 4, 6, 1e-6


def make_case(num_tokens, heads, kv_heads, head_dim, dtype, qk_norm, seed=0):
    """A projection output with a wider row stride than its width (a view of a bigger
    buffer), caches full of junk, slots scattered over blocks with one padding row."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=gen) * scale + shift).to(dtype).to(DEVICE)

    width = (heads + 2 * kv_heads) * head_dim
    qkv = rand(num_tokens, width + 6, scale=2.0)[:, :width]
    positions = torch.randint(0, 200, (num_tokens,), generator=gen).to(DEVICE)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:num_tokens]
    slots[num_tokens // 2] = -1
    cache_shape = (NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim)
    return dict(
        qkv=qkv, num_heads=heads, num_kv_heads=kv_heads, positions=positions,
        cos_sin=build_rope_cache(head_dim, 256, 1e6, None, DEVICE),
        q_weight=rand(head_dim, scale=0.2, shift=1.0) if qk_norm else None,
        k_weight=rand(head_dim, scale=0.2, shift=1.0) if qk_norm else None,
        eps=EPS, k_cache=rand(*cache_shape), v_cache=rand(*cache_shape),
        slot_mapping=slots.to(torch.int32).to(DEVICE),
    )


def run(fn, case):
    """-> (q, k_cache, v_cache) after running fn on a copy of the case's caches."""
    case = dict(case, k_cache=case["k_cache"].clone(), v_cache=case["v_cache"].clone())
    return fn(**case), case["k_cache"], case["v_cache"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "tokens,heads,kv_heads,head_dim,qk_norm",
    [
        (5, 6, 2, 32, True),  # a TP rank's uneven shard of Qwen3-like heads
        (5, 3, 1, 16, True),  # odd head count
        (4, 3, 1, 16, False),  # Llama/Qwen2: rotary and store only
        (3, 1, 1, 8, True),
        (2, 16, 8, 128, True),  # the Qwen3-0.6B shape
        (9, 9, 3, 64, False),  # SmolLM2's: 12 head rows padded to 16, no q/k norm
        (3, 4, 2, 80, True),  # a head_dim that is no power of two: masked halves and v rows
    ],
)
def test_triton_matches_ref(tokens, heads, kv_heads, head_dim, qk_norm, dtype):
    case = make_case(tokens, heads, kv_heads, head_dim, dtype, qk_norm)
    got = run(qk_norm_rope_store_triton, case)
    want = run(qk_norm_rope_store_ref, case)
    assert got[0].shape == (tokens, heads, head_dim) and got[0].dtype == dtype
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL[dtype])
    # v is copied, not computed: bit-exact, and the padding row and other slots untouched.
    assert torch.equal(got[2], want[2])
    written = case["slot_mapping"].long()
    untouched = torch.ones(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool, device=DEVICE)
    untouched[written[written >= 0]] = False
    flat = got[1].view(-1, kv_heads, head_dim)
    assert torch.equal(flat[untouched], case["k_cache"].view(-1, kv_heads, head_dim)[untouched])


@pytest.mark.parametrize("qk_norm", [True, False])
def test_ref_equals_unfused_ops(qk_norm):
    """The reference is the decoder's former sequence, bit for bit (CPU parity rests on it)."""
    heads, kv_heads, d = 6, 2, 16
    case = make_case(7, heads, kv_heads, d, torch.bfloat16, qk_norm, seed=3)
    q, kc, vc = run(qk_norm_rope_store_ref, case)
    t = case["qkv"].shape[0]
    q0, k0, v0 = case["qkv"].split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    if qk_norm:
        q0 = rms_norm_ref(q0.reshape(-1, d), case["q_weight"], EPS)
        k0 = rms_norm_ref(k0.reshape(-1, d), case["k_weight"], EPS)
    q0, k0 = apply_rotary_ref(q0.reshape(t, heads, d), k0.reshape(t, kv_heads, d),
                              case["positions"], case["cos_sin"])
    kc0, vc0 = case["k_cache"].clone(), case["v_cache"].clone()
    store_kv_ref(k0, v0.reshape(t, kv_heads, d), kc0, vc0, case["slot_mapping"])
    assert torch.equal(q, q0) and torch.equal(kc, kc0) and torch.equal(vc, vc0)


def test_dispatch_and_errors():
    case = make_case(3, 3, 1, 16, torch.float32, True)
    want = run(qk_norm_rope_store_ref, case)
    for g, w in zip(run(qk_norm_rope_store, case), want):
        torch.testing.assert_close(g, w, **TOL[torch.float32])
    empty = dict(case, qkv=case["qkv"][:0], positions=case["positions"][:0],
                 slot_mapping=case["slot_mapping"][:0])
    assert run(qk_norm_rope_store_triton, empty)[0].shape == (0, 3, 16)
    with pytest.raises(ValueError, match="num_heads"):
        qk_norm_rope_store_ref(**dict(case, num_heads=4))
    with pytest.raises(ValueError, match="together"):
        qk_norm_rope_store_ref(**dict(case, k_weight=None))
    with pytest.raises(ValueError, match="slot_mapping"):
        qk_norm_rope_store_ref(**dict(case, slot_mapping=case["slot_mapping"][:2]))
    with pytest.raises(ValueError, match="positions"):
        qk_norm_rope_store_ref(**dict(case, positions=case["positions"].float()))
    with pytest.raises(ValueError, match="cache heads"):
        qk_norm_rope_store_ref(**dict(case, num_heads=1, num_kv_heads=2))
