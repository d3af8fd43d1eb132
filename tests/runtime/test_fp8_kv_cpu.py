"""The fp8 KV cache on the CPU path: the fused CPU store and decode attention against the
references, the host tier's copies, the runner's pool (dtype, twice the blocks) and the
checkpoint's k_scale/v_scale."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from random_prompts import random_prompts
from rt_helpers import BLOCK_SIZE, make_runner
from rt_planner import Planner
from safetensors.torch import save_file

from gpu_workers.block_mover import BlockMover, gather_blocks, make_host_pool, scatter_blocks
from gpu_workers.layers.attention import AttentionBatch
from gpu_workers.layers.cpu_attention import CPUStep, attend, prepare_qkv
from kernels import qk_norm_rope_store_ref
from kernels.kv_quant import FP8_KV_DTYPE, quantize
from kernels.paged_decode_attention import paged_decode_attention_ref
from kernels.rotary import build_rope_cache

H, HKV, D, NUM_BLOCKS = 4, 2, 16, 12
KS, VS = 0.25, 2.0


def _fp8_caches(n: int) -> list[torch.Tensor]:
    return [torch.zeros(NUM_BLOCKS, BLOCK_SIZE, HKV, D, dtype=FP8_KV_DTYPE) for _ in range(n)]


def test_cpu_store_writes_the_references_bytes_and_saturates():
    torch.manual_seed(1)
    t = 5
    qkv = torch.randn(t, (H + 2 * HKV) * D) * 200  # past 448 * scale: saturates
    positions = torch.tensor([0, 7, 19, 40, 63])
    slots = torch.tensor([3, 40, -1, 100, 191], dtype=torch.int32)
    cos_sin = build_rope_cache(D, 64, 1e4, None, "cpu")
    caches = _fp8_caches(4)
    ref_q = qk_norm_rope_store_ref(qkv, H, HKV, positions, cos_sin, None, None, 1e-6,
                                   caches[0], caches[1], slots, KS, VS)
    batch = AttentionBatch(slot_mapping=slots, block_tables=torch.zeros(t, 1, dtype=torch.int32),
                           cu_seqlens_q=torch.arange(t + 1, dtype=torch.int32),
                           seq_lens_k=torch.ones(t, dtype=torch.int32), cu_seqlens_k=None,
                           max_seqlen_q=1, max_seqlen_k=1, decode=False)
    step = CPUStep.build(batch, positions, cos_sin, torch.float32, NUM_BLOCKS, BLOCK_SIZE, HKV)
    q = prepare_qkv(qkv, H, HKV, D, step, None, None, caches[2], caches[3], KS, VS)
    assert torch.equal(q, ref_q)
    for mine, ref in ((caches[2], caches[0]), (caches[3], caches[1])):
        assert torch.equal(mine.view(torch.uint8), ref.view(torch.uint8))
        assert not mine.float().isnan().any()
    assert caches[2].float().abs().max() == 448  # k / 0.25 goes past the largest fp8
    stored = caches[3].view(-1, HKV, D)[40]
    v = qkv[1, (H + HKV) * D:].view(HKV, D)
    assert torch.equal(stored.view(torch.uint8), quantize(v, VS, FP8_KV_DTYPE).view(torch.uint8))


def test_cpu_decode_attention_over_fp8_matches_the_reference():
    torch.manual_seed(0)
    k_cache = quantize(torch.randn(NUM_BLOCKS, BLOCK_SIZE, HKV, D), KS, FP8_KV_DTYPE)
    v_cache = quantize(torch.randn(NUM_BLOCKS, BLOCK_SIZE, HKV, D), VS, FP8_KV_DTYPE)
    lens, tables = [5, 33, 16], [[7], [2, 9, 4], [11, 3]]
    bt = torch.tensor([t + [987654] * (3 - len(t)) for t in tables], dtype=torch.int32)
    batch = AttentionBatch(
        slot_mapping=torch.tensor([116, 64, 191], dtype=torch.int32), block_tables=bt,
        cu_seqlens_q=torch.arange(4, dtype=torch.int32),
        seq_lens_k=torch.tensor(lens, dtype=torch.int32), cu_seqlens_k=None,
        max_seqlen_q=1, max_seqlen_k=max(lens), decode=True)
    q = torch.randn(3, H, D)
    step = CPUStep.build(batch, torch.tensor([4, 32, 15]), build_rope_cache(D, 64, 1e4, None,
                                                                            "cpu"),
                         torch.float32, NUM_BLOCKS, BLOCK_SIZE, HKV)
    out = attend(q, k_cache, v_cache, batch, step, D**-0.5, KS, VS)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, batch.block_tables, batch.seq_lens_k,
                                     D**-0.5, 1, KS, VS)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    plain = attend(q, k_cache.float() * KS, v_cache.float() * VS, batch, step, D**-0.5)
    torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-6)


def test_the_host_tier_and_hand_offs_move_fp8_blocks_byte_for_byte():
    g = torch.Generator().manual_seed(0)
    device = (torch.randn(2, 3, 6, 4, 2, 8, generator=g) * 50).to(FP8_KV_DTYPE)
    original = device.clone()
    mover = BlockMover(device, make_host_pool(device, 4))
    assert mover.host_pool.dtype == FP8_KV_DTYPE
    mover.store([5, 1], [2, 0])
    device.view(torch.uint8).zero_()
    mover.load([0, 2], [4, 0])
    assert torch.equal(device[:, :, 4].view(torch.uint8), original[:, :, 1].view(torch.uint8))
    assert torch.equal(device[:, :, 0].view(torch.uint8), original[:, :, 5].view(torch.uint8))
    assert mover.bytes_stored == 2 * 2 * 3 * 4 * 2 * 8  # one byte a value
    other = torch.zeros_like(original)
    scatter_blocks(other, [3, 0], gather_blocks(original, [1, 2]))
    assert torch.equal(other[:, :, 3].view(torch.uint8), original[:, :, 1].view(torch.uint8))


def _run_prompts(runner) -> list[list[int]]:
    planner = Planner(BLOCK_SIZE, runner.num_kv_blocks)
    for i, p in enumerate(random_prompts(5, [3, 17, 40])):
        planner.add(i, p, max_tokens=10)
    return list(planner.run(runner).values())


def test_an_fp8_pool_holds_twice_the_blocks_and_generates(tiny_qwen3_dir):
    # float32 weights: fp8 is a quarter of the bytes, bf16 half; the budget is the same.
    auto = make_runner(tiny_qwen3_dir, dtype="bfloat16")
    fp8 = make_runner(tiny_qwen3_dir, dtype="bfloat16", kv_cache_dtype="fp8_e4m3")
    assert fp8.kv_cache.storage.dtype == FP8_KV_DTYPE
    assert auto.kv_cache.storage.dtype == torch.bfloat16
    assert fp8.num_kv_blocks == 2 * auto.num_kv_blocks
    outs = _run_prompts(fp8)
    assert all(len(o) == 10 for o in outs)


def test_the_checkpoints_kv_scales_are_loaded(tiny_qwen3_dir, tmp_path):
    model = Path(tmp_path, "scaled")
    shutil.copytree(tiny_qwen3_dir, model)
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(0.5),
               "model.layers.1.self_attn.v_proj.v_scale": torch.tensor([0.125])},
              str(model / "kv_scales.safetensors"))
    _add_to_index(model, ["model.layers.0.self_attn.k_scale",
                          "model.layers.1.self_attn.v_proj.v_scale"], "kv_scales.safetensors")
    runner = make_runner(str(model), kv_cache_dtype="fp8")
    layers = runner.model.attention_layers()
    assert layers[0].scales == {"k_scale": 0.5, "v_scale": 1.0}
    assert layers[1].scales == {"k_scale": 1.0, "v_scale": 0.125}
    assert all(len(o) == 10 for o in _run_prompts(runner))
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(-1.0)},
              str(model / "kv_scales.safetensors"))
    with pytest.raises(ValueError, match="positive and finite"):
        make_runner(str(model), kv_cache_dtype="fp8")


def _add_to_index(model: Path, names: list[str], file: str) -> None:
    """Name an extra checkpoint file: in the shard index when there is one."""
    import json

    index = model / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"].update({n: file for n in names})
        index.write_text(json.dumps(data))
