"""CPU matmuls over oneDNN-reordered weights (gpu_workers.layers.cpu_linear): the same
products as F.linear, every layer of a CPU runner reordered once, and the same greedy tokens
as the plain weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from random_prompts import random_prompts
from rt_helpers import BLOCK_SIZE, make_runner
from rt_planner import Planner

from gpu_workers.layers import cpu_linear
from gpu_workers.layers.embedding import ParallelLMHead
from gpu_workers.layers.linear import ColumnParallelLinear, RowParallelLinear
from gpu_workers.layers.parallel import TPInfo

needs_onednn = pytest.mark.skipif(not cpu_linear.onednn_wanted(), reason="no oneDNN in torch")


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 5, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_linear_equals_f_linear(rows, bias):
    torch.manual_seed(rows)
    w, b = torch.randn(96, 40), torch.randn(96) if bias else None
    x = torch.randn(rows, 40)
    reordered = cpu_linear.onednn_layout(w)
    assert reordered is not None
    torch.testing.assert_close(cpu_linear.onednn_linear(x, reordered, b), F.linear(x, w, b))
    x3 = torch.randn(2, rows, 40)  # leading dimensions pass through
    torch.testing.assert_close(cpu_linear.onednn_linear(x3, reordered, b), F.linear(x3, w, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layer_computes_the_same_whichever_weight_it_keeps(dtype):
    """bf16 needs AVX-512 or AVX-NE-CONVERT in oneDNN: without them the layer stays plain."""
    torch.manual_seed(0)
    layer = ColumnParallelLinear(48, [range(0, 80)], True, TPInfo(0, 1), dtype, "cpu")
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    cpu_linear.use_onednn_weights(layer)
    assert (layer.weight is None) == (layer.onednn_weight is not None)
    x = torch.randn(7, 48, dtype=dtype)
    torch.testing.assert_close(layer(x), F.linear(x, w, b))


@needs_onednn
def test_a_cpu_runner_reorders_every_linear_and_the_tied_head(tiny_qwen3_dir):
    model = make_runner(tiny_qwen3_dir).model
    matmuls = [m for m in model.modules()
               if isinstance(m, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead))]
    assert matmuls and all(m.onednn_weight is not None and m.weight is None for m in matmuls)
    if model.config.tie_word_embeddings:  # the lookup keeps the plain rows
        assert model.model.embed_tokens.weight is not None


def _greedy_tokens(model_dir: str) -> dict[int, list[int]]:
    runner = make_runner(model_dir)
    planner = Planner(BLOCK_SIZE, runner.num_kv_blocks)
    for i, p in enumerate(random_prompts(5, [3, 17, 40, 70])):
        planner.add(i, p, max_tokens=10 + i)
    return planner.run(runner)


@needs_onednn
def test_greedy_tokens_equal_those_of_the_plain_weights(tiny_llama_dir, monkeypatch):
    reordered = _greedy_tokens(tiny_llama_dir)
    monkeypatch.setenv(cpu_linear.PLAIN_ENV, "1")
    assert make_runner(tiny_llama_dir).model.lm_head.onednn_weight is None
    assert reordered == _greedy_tokens(tiny_llama_dir)
