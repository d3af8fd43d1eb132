"""The CPU path (gpu_workers.layers.cpu_attention): the same results as the reference kernels,
with the per-step work shared by every layer."""

from __future__ import annotations

import pytest
import torch
from random_prompts import random_prompts
from rt_helpers import BLOCK_SIZE, make_runner
from rt_planner import Planner

from gpu_workers.layers.attention import AttentionBatch
from gpu_workers.layers.cpu_attention import CPUStep, attend, prepare_qkv
from gpu_workers.layers.norm import RMSNorm
from kernels import qk_norm_rope_store_ref
from kernels.paged_decode_attention import paged_decode_attention_ref
from kernels.rms_norm import add_rms_norm_ref, rms_norm_ref
from kernels.rotary import build_rope_cache

MODELS = ["tiny_qwen3_dir", "tiny_llama_dir"]
H, HKV, D, NUM_BLOCKS = 4, 2, 16, 12


@pytest.fixture(params=MODELS)
def model_dir(request) -> str:
    return request.getfixturevalue(request.param)


def _decode_batch(lens: list[int], tables: list[list[int]], slots: list[int]) -> AttentionBatch:
    width = max(map(len, tables))
    bt = torch.tensor([t + [987654] * (width - len(t)) for t in tables], dtype=torch.int32)
    n = len(lens)
    return AttentionBatch(
        slot_mapping=torch.tensor(slots, dtype=torch.int32), block_tables=bt,
        cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32),
        seq_lens_k=torch.tensor(lens, dtype=torch.int32), cu_seqlens_k=None,
        max_seqlen_q=1, max_seqlen_k=max(lens), decode=True)


def test_runner_on_cpu_takes_the_cpu_path(tiny_llama_dir):
    assert make_runner(tiny_llama_dir).model.model.cpu_path
    # An explicit "triton" on the CPU runs the references, op by op.
    assert not make_runner(tiny_llama_dir, attention_backend="triton").model.model.cpu_path


def test_greedy_tokens_equal_the_reference_path(model_dir):
    """Mixed lengths (masked decode batches), a chunked prompt next to decodes and a shared
    prefix: the CPU path and the references pick the same tokens."""
    outs = []
    for backend in ("torch", "triton"):  # the CPU path, then the references
        runner = make_runner(model_dir, attention_backend=backend)
        planner = Planner(BLOCK_SIZE, runner.num_kv_blocks)
        prompts = random_prompts(11, [3, 16, 17, 41, 70])
        first = planner.add(0, prompts[0] + prompts[3], max_tokens=6)
        planner.run(runner)
        for i, p in enumerate(prompts[1:], start=1):
            planner.add(i, p, max_tokens=12 + i)
        shared = (prompts[0] + prompts[3])[:2 * BLOCK_SIZE] + prompts[1][:5]
        planner.add(9, shared, max_tokens=9, shared_blocks=first.blocks[:2],
                    num_cached=2 * BLOCK_SIZE)
        for _ in range(4):
            planner.apply(runner.execute(planner.plan(chunks={4: 13})))
        outs.append(planner.run(runner))
    assert outs[0] == outs[1]


def test_decode_attention_matches_the_reference():
    """Different lengths (the mask), unused table entries holding garbage, GQA groups."""
    torch.manual_seed(0)
    k_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, HKV, D)
    v_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, HKV, D)
    batch = _decode_batch([5, 33, 16], [[7], [2, 9, 4], [11, 3]], [116, 64, 191])
    q = torch.randn(3, H, D)
    step = CPUStep.build(batch, torch.tensor([4, 32, 15]), build_rope_cache(D, 64, 1e4, None,
                                                                            "cpu"),
                         torch.float32, NUM_BLOCKS, BLOCK_SIZE, HKV)
    assert step.gather is not None and step.gather.mask is not None
    out = attend(q, k_cache, v_cache, batch, step, D**-0.5)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, batch.block_tables, batch.seq_lens_k,
                                     D**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_equal_lengths_need_no_mask():
    batch = _decode_batch([20, 20], [[1, 2], [3, 4]], [35, 67])
    step = CPUStep.build(batch, torch.tensor([19, 19]), build_rope_cache(D, 64, 1e4, None, "cpu"),
                         torch.float32, NUM_BLOCKS, BLOCK_SIZE, HKV)
    assert step.gather.mask is None


@pytest.mark.parametrize("qk_norm", [False, True])
def test_prepare_qkv_equals_the_reference_bit_for_bit(qk_norm):
    """Rotary (and Qwen3's q/k norms) round as the reference does, and k/v land in the same
    slots; a padding token (slot -1) stores nothing."""
    torch.manual_seed(1)
    t = 5
    qkv = torch.randn(t, (H + 2 * HKV) * D)
    positions = torch.tensor([0, 7, 19, 40, 63])
    slots = torch.tensor([3, 40, -1, 100, 191], dtype=torch.int32)
    cos_sin = build_rope_cache(D, 64, 1e4, None, "cpu")
    qw, kw = (torch.randn(D), torch.randn(D)) if qk_norm else (None, None)
    caches = [torch.zeros(NUM_BLOCKS, BLOCK_SIZE, HKV, D) for _ in range(4)]
    ref_q = qk_norm_rope_store_ref(qkv, H, HKV, positions, cos_sin, qw, kw, 1e-6, caches[0],
                                   caches[1], slots)
    batch = AttentionBatch(slot_mapping=slots, block_tables=torch.zeros(t, 1, dtype=torch.int32),
                           cu_seqlens_q=torch.arange(t + 1, dtype=torch.int32),
                           seq_lens_k=torch.ones(t, dtype=torch.int32), cu_seqlens_k=None,
                           max_seqlen_q=1, max_seqlen_k=1, decode=False)
    step = CPUStep.build(batch, positions, cos_sin, torch.float32, NUM_BLOCKS, BLOCK_SIZE, HKV)
    norms = [None, None]
    if qk_norm:
        norms = [RMSNorm(D, 1e-6, torch.float32, "cpu") for _ in range(2)]
        norms[0].weight.data.copy_(qw)
        norms[1].weight.data.copy_(kw)
    q = prepare_qkv(qkv, H, HKV, D, step, norms[0], norms[1], caches[2], caches[3])
    assert torch.equal(q, ref_q)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
    assert caches[2].flatten(0, 1).abs().sum(dim=(1, 2)).count_nonzero() == 4


def test_rms_norm_module_equals_the_reference_bit_for_bit():
    torch.manual_seed(2)
    norm = RMSNorm(96, 1e-5, torch.float32, "cpu")
    norm.weight.data.normal_()
    x, res = torch.randn(7, 96) * 3, torch.randn(7, 96)
    assert torch.equal(norm(x), rms_norm_ref(x, norm.weight, 1e-5))
    out, summed = norm(x, res)
    ref_out, ref_sum = add_rms_norm_ref(x, res, norm.weight, 1e-5)
    assert torch.equal(out, ref_out) and torch.equal(summed, ref_sum)
