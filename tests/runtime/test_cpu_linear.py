"""CPU matmuls over oneDNN-reordered weights (gpu_workers.layers.cpu_linear): the same
products as F.linear, every layer of a CPU runner reordered once (its plain weight kept too
for steps of a row or two where the CPU is Intel's), and the same greedy tokens as the plain
weights."""

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


def _random_layer(dtype: torch.dtype = torch.float32) -> ColumnParallelLinear:
    torch.manual_seed(0)
    layer = ColumnParallelLinear(48, [range(0, 80)], True, TPInfo(0, 1), dtype, "cpu")
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    return layer


@pytest.mark.parametrize("keep_plain", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layer_computes_the_same_whichever_weight_it_keeps(dtype, keep_plain, monkeypatch):
    """bf16 needs AVX-512 or AVX-NE-CONVERT in oneDNN: without them the layer stays plain."""
    monkeypatch.setattr(cpu_linear, "few_rows_take_plain", lambda: keep_plain)
    layer = _random_layer(dtype)
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    cpu_linear.use_onednn_weights(layer)
    if layer.onednn_weight is not None:
        assert (layer.weight is not None) == keep_plain
    for rows in (1, 2, 7):
        x = torch.randn(rows, 48, dtype=dtype)
        torch.testing.assert_close(layer(x), F.linear(x, w, b))


@needs_onednn
def test_with_both_weights_few_rows_take_the_plain_one_and_more_rows_onednn(monkeypatch):
    """Which weight a product read, told apart by zeroing the plain copy after the reorder."""
    monkeypatch.setattr(cpu_linear, "few_rows_take_plain", lambda: True)
    layer = _random_layer()
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    cpu_linear.use_onednn_weights(layer)
    assert layer.onednn_weight is not None and layer.weight is not None
    with torch.no_grad():
        layer.weight.zero_()
    for rows in range(1, cpu_linear.FEW_ROWS + 1):
        x = torch.randn(rows, 48)
        torch.testing.assert_close(layer(x), b.expand(rows, -1))
        x3 = x[None]  # leading dimensions count as rows
        torch.testing.assert_close(layer(x3), b.expand(1, rows, -1))
    x = torch.randn(cpu_linear.FEW_ROWS + 1, 48)
    torch.testing.assert_close(layer(x), F.linear(x, w, b))


def test_the_choice_follows_the_cpu_vendor(monkeypatch):
    """MKL's GEMV is tuned for Intel's CPUs; on AMD's it takes a generic path."""
    monkeypatch.setattr(cpu_linear, "cpu_vendor", lambda: "GenuineIntel")
    assert cpu_linear.few_rows_take_plain() == torch.backends.mkl.is_available()
    monkeypatch.setattr(cpu_linear, "cpu_vendor", lambda: "AuthenticAMD")
    assert not cpu_linear.few_rows_take_plain()
    monkeypatch.setattr(cpu_linear, "cpu_vendor", lambda: "")
    assert not cpu_linear.few_rows_take_plain()


@needs_onednn
@pytest.mark.parametrize("keep_plain", [False, True])
def test_a_cpu_runner_reorders_every_linear_and_the_tied_head(tiny_qwen3_dir, keep_plain,
                                                             monkeypatch):
    monkeypatch.setattr(cpu_linear, "few_rows_take_plain", lambda: keep_plain)
    model = make_runner(tiny_qwen3_dir).model
    matmuls = [m for m in model.modules()
               if isinstance(m, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead))]
    assert matmuls and all(m.onednn_weight is not None for m in matmuls)
    assert all((m.weight is not None) == keep_plain for m in matmuls)
    if model.config.tie_word_embeddings:  # the lookup keeps the plain rows
        assert model.model.embed_tokens.weight is not None


def _greedy_tokens(model_dir: str) -> dict[int, list[int]]:
    runner = make_runner(model_dir)
    planner = Planner(BLOCK_SIZE, runner.num_kv_blocks)
    for i, p in enumerate(random_prompts(5, [3, 17, 40, 70])):
        planner.add(i, p, max_tokens=10 + i)
    return planner.run(runner)


@needs_onednn
@pytest.mark.parametrize("keep_plain", [False, True])
def test_greedy_tokens_equal_those_of_the_plain_weights(tiny_llama_dir, keep_plain,
                                                         monkeypatch):
    monkeypatch.setattr(cpu_linear, "few_rows_take_plain", lambda: keep_plain)
    reordered = _greedy_tokens(tiny_llama_dir)
    monkeypatch.setattr(cpu_linear, "onednn_wanted", lambda: False)
    assert make_runner(tiny_llama_dir).model.lm_head.onednn_weight is None
    assert reordered == _greedy_tokens(tiny_llama_dir)
