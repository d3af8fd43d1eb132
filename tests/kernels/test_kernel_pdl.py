"""Programmatic dependent launch: a chain of kernels that each read the previous one's output,
replayed as a CUDA graph with every kernel launched early, equals the same chain op by op.

A kernel that read an activation before `pdl_wait` would see its predecessor's half-written
output here: each layer's input is the previous kernel's result, and the chain is long.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import _common
from kernels.norm_linear import norm_linear_ref, norm_linear_triton
from kernels.skinny_linear import skinny_linear_triton


def test_never_on_the_cpu():
    assert not _common.use_pdl(torch.zeros(1))


def _chain(x, layers, linear, norm_linear):
    residual = x
    for w1, g, w2 in layers:
        h, residual = norm_linear(x, residual, g, 1e-6, w1)
        x = linear(h, w2) / 8
    return x, residual


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available()
                    or torch.cuda.get_device_capability()[0] < 9, reason="needs Hopper or later")
def test_a_graph_of_early_launched_kernels_equals_the_chain_op_by_op():
    assert _common.use_pdl(torch.zeros(1, device="cuda")) == _common.PDL_ENABLED
    gen = torch.Generator(device="cuda").manual_seed(0)
    k, n = 1024, 3072

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda") / shape[-1] ** 0.5

    layers = [(rand(n, k), 1 + rand(k), rand(k, n)) for _ in range(24)]
    x = torch.randn(1, k, generator=gen, device="cuda")
    _chain(x, layers, skinny_linear_triton, norm_linear_triton)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, residual = _chain(x, layers, skinny_linear_triton, norm_linear_triton)
    for seed in range(5):
        x.copy_(torch.randn(1, k, generator=gen.manual_seed(seed + 1), device="cuda"))
        graph.replay()
        want, want_res = _chain(x, layers, F.linear, norm_linear_ref)
        torch.testing.assert_close(out, want, rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(residual, want_res, rtol=1e-3, atol=1e-3)
