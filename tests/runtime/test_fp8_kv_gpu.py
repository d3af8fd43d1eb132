"""The fp8 KV cache on CUDA: warm-up and CUDA graphs run with it, graphs give the eager
tokens, the Triton kernels give the tokens of the torch references over the same fp8 cache,
and the pool holds twice the blocks of bf16 in the same bytes."""

from __future__ import annotations

import pytest
import torch
from random_prompts import random_prompts
from rt_helpers import BLOCK_SIZE, make_runner
from rt_planner import Planner

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    yield
    import gc

    gc.collect()
    torch.cuda.empty_cache()


def _generate(runner, max_tokens: int = 24) -> dict[int, list[int]]:
    planner = Planner(BLOCK_SIZE, runner.num_kv_blocks)
    for i, p in enumerate(random_prompts(21, [1, 5, 17, 33, 64, 100, 3, 9, 12])):
        planner.add(i, p, max_tokens)
    return planner.run(runner)


def _runner(model_dir, **kw):
    return make_runner(model_dir, **{"device": "cuda", "dtype": "bfloat16",
                                     "kv_cache_bytes": 8 << 20, "kv_cache_dtype": "fp8", **kw})


def test_fp8_kv_with_cuda_graphs_gives_the_eager_tokens(tiny_qwen3_dir):
    graphed = _runner(tiny_qwen3_dir)
    assert graphed.graphs is not None
    assert graphed.kv_cache.storage.dtype == torch.float8_e4m3fn
    assert _generate(graphed) == _generate(_runner(tiny_qwen3_dir, enforce_eager=True))


def test_fp8_kv_triton_kernels_give_the_torch_reference_tokens(tiny_qwen3_dir):
    """In float32 both paths store the same fp8 values and differ only in summation order.
    (In bf16 they also round k and v at different points before quantizing; a random tiny
    model's near-ties then flip greedy tokens, and one flip changes the rest of a sequence.)"""
    kw = dict(dtype="float32", enforce_eager=True)
    tokens = _generate(_runner(tiny_qwen3_dir, **kw))
    reference = _generate(_runner(tiny_qwen3_dir, attention_backend="torch", **kw))
    pairs = [(a, b) for s in tokens for a, b in zip(tokens[s], reference[s], strict=True)]
    assert sum(a == b for a, b in pairs) / len(pairs) > 0.95, (tokens, reference)


def test_fp8_holds_twice_the_bf16_blocks(tiny_qwen3_dir):
    fp8 = _runner(tiny_qwen3_dir).num_kv_blocks
    auto = _runner(tiny_qwen3_dir, kv_cache_dtype="auto").num_kv_blocks
    assert 2 * auto <= fp8 <= 2 * auto + 1  # the same 8 MiB cap, half the bytes a block


def test_flash_attn_with_fp8_is_refused(tiny_qwen3_dir):
    with pytest.raises(ValueError, match="needs the Triton attention kernels"):
        _runner(tiny_qwen3_dir, attention_backend="flash_attn", block_size=256)
