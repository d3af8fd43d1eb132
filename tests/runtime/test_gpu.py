"""CUDA paths: Triton kernels, CUDA graphs for decode, memory-based KV sizing."""

from __future__ import annotations

import pytest
from hf_reference import hf_greedy
from random_prompts import random_prompts
from rt_helpers import BLOCK_SIZE, make_runner
from rt_planner import Planner

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    """Runners size their KV pool from free memory: give back what earlier tests held."""
    yield
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()


def _generate(runner, ps, max_tokens):
    planner = Planner(BLOCK_SIZE, runner.num_kv_blocks)
    for i, p in enumerate(ps):
        planner.add(i, p, max_tokens)
    return planner.run(runner)


def _util(extra: float) -> float:
    """A memory-utilization target `extra` above what the process already uses."""
    import torch

    free, total = torch.cuda.mem_get_info()
    return min(0.95, (total - free) / total + extra)


def _cuda_runner(model_dir, **kw):
    return make_runner(model_dir, **{"device": "cuda", "kv_cache_bytes": None,
                                     "gpu_memory_utilization": _util(0.05), **kw})


def test_cuda_graphs_match_eager_and_transformers(tiny_qwen3_dir):
    ps = random_prompts(21, [1, 5, 17, 33, 64, 100, 3, 9, 12])
    eager = _generate(_cuda_runner(tiny_qwen3_dir, enforce_eager=True), ps, 24)
    graphed_runner = _cuda_runner(tiny_qwen3_dir)
    assert graphed_runner.graphs is not None
    assert _generate(graphed_runner, ps, 24) == eager
    # float32 computes in float32 on the GPU too (IEEE dots): transformers float32 on the same
    # GPU gives the same tokens.
    for i, p in enumerate(ps):
        assert eager[i] == hf_greedy(tiny_qwen3_dir, p, 24, device="cuda"), f"prompt {i}"


@pytest.mark.parametrize("model", ["tiny_qwen3_dir", "tiny_llama_dir"])
def test_one_sequence_decodes_through_the_fused_gemvs_like_transformers(model, request):
    """Batch 1 runs the skinny GEMVs with the norms and SiLU-mul inside (kernels.norm_linear,
    kernels.skinny_linear): in float32 its greedy tokens are transformers' on the same GPU."""
    model_dir = request.getfixturevalue(model)
    runner = _cuda_runner(model_dir)
    for p in random_prompts(23, [6, 40]):
        assert _generate(runner, [p], 24)[0] == hf_greedy(model_dir, p, 24, device="cuda")


def test_kv_pool_sized_from_free_memory(tiny_llama_dir):
    import gc

    import torch

    sizes = []
    for extra in (0.05, 0.10):
        runner = _cuda_runner(tiny_llama_dir, gpu_memory_utilization=_util(extra),
                              enforce_eager=True)
        sizes.append(runner.num_kv_blocks)
        del runner
        gc.collect()
        torch.cuda.empty_cache()
    assert sizes[1] > sizes[0] > 0


def test_bf16_triton_backend_runs_mixed_batches(tiny_llama_dir):
    runner = _cuda_runner(tiny_llama_dir, dtype="bfloat16", attention_backend="triton")
    out = _generate(runner, random_prompts(22, [2, 40, 90]), 16)
    assert all(len(v) == 16 for v in out.values())
