"""The fused q/k-norm + rotary + KV-store kernel against its reference on a GPU, bf16, at the
Qwen3-0.6B shape and its tensor-parallel shards, decode and prefill sized, inside a CUDA graph
too (the decode path replays one)."""

from __future__ import annotations

import pytest
import torch

from kernels.qk_norm_rope_store import qk_norm_rope_store_ref, qk_norm_rope_store_triton
from kernels.rotary import build_rope_cache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
D, BS, BF16 = 128, 256, dict(atol=2e-2, rtol=2e-2)


def make_case(tokens: int, heads: int, kv_heads: int, seed: int = 0) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    num_blocks = -(-tokens // BS) + 4
    cache = (num_blocks, BS, kv_heads, D)
    slots = torch.randperm(num_blocks * BS, generator=gen, device="cuda")[:tokens]
    slots[::7] = -1
    return dict(
        qkv=torch.randn(tokens, (heads + 2 * kv_heads) * D, generator=gen, device="cuda",
                        dtype=torch.bfloat16),
        num_heads=heads, num_kv_heads=kv_heads,
        positions=torch.randint(0, 4000, (tokens,), generator=gen, device="cuda",
                                dtype=torch.int32),
        cos_sin=build_rope_cache(D, 4096, 1e6, None, "cuda"),
        q_weight=1 + 0.2 * torch.randn(D, generator=gen, device="cuda", dtype=torch.bfloat16),
        k_weight=1 + 0.2 * torch.randn(D, generator=gen, device="cuda", dtype=torch.bfloat16),
        eps=1e-6,
        k_cache=torch.randn(cache, generator=gen, device="cuda", dtype=torch.bfloat16),
        v_cache=torch.randn(cache, generator=gen, device="cuda", dtype=torch.bfloat16),
        slot_mapping=slots.to(torch.int32),
    )


def run(fn, case: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    case = dict(case, k_cache=case["k_cache"].clone(), v_cache=case["v_cache"].clone())
    return fn(**case), case["k_cache"], case["v_cache"]


@pytest.mark.parametrize("heads,kv_heads", [(16, 8), (8, 4), (6, 2), (3, 1)])
@pytest.mark.parametrize("tokens", [170, 4096])
def test_fused_qkv_real_shape(tokens, heads, kv_heads):
    case = make_case(tokens, heads, kv_heads)
    got, want = run(qk_norm_rope_store_triton, case), run(qk_norm_rope_store_ref, case)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **BF16)
    assert torch.equal(got[2], want[2])  # v is copied bit for bit


def test_fused_qkv_in_cuda_graph():
    case = make_case(170, 16, 8)
    want = run(qk_norm_rope_store_ref, case)
    kc, vc = case["k_cache"].clone(), case["v_cache"].clone()
    args = dict(case, k_cache=kc, v_cache=vc)
    qkv_triton = lambda: qk_norm_rope_store_triton(**args)
    qkv_triton()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    kc.copy_(case["k_cache"])
    vc.copy_(case["v_cache"])
    with torch.cuda.graph(graph):
        q = qkv_triton()
    graph.replay()
    torch.cuda.synchronize()
    for g, w in zip((q, kc, vc), want):
        torch.testing.assert_close(g, w, **BF16)
