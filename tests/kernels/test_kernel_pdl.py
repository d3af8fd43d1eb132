"""Programmatic dependent launch: the decode layers' kernels, each reading what the one before
wrote, replayed as a CUDA graph with every kernel launched early, equal the same layers op by
op through the references.

A kernel that read an activation, a residual or the KV cache before `pdl_wait` would see its
predecessor's half-written output here: every kernel of the chain follows another
early-launched one, as in a batch-1 decode step (norm + QKV GEMV, q/k norm + rotary + KV
store, decode attention and its reduce, o_proj GEMV, norm + gate/up GEMV, SiLU-mul + down
GEMV). On the CPU the same chain runs interpreted, without PDL, so the test's own logic is
checked in CI.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from kernels import _common
from kernels.activation import silu_and_mul_ref
from kernels.norm_linear import norm_linear_ref, norm_linear_triton
from kernels.paged_decode_attention import (
    paged_decode_attention_ref,
    paged_decode_attention_triton,
)
from kernels.qk_norm_rope_store import qk_norm_rope_store_ref, qk_norm_rope_store_triton
from kernels.rotary import build_rope_cache
from kernels.skinny_linear import skinny_linear_triton

EPS = 1e-6
GPU = torch.cuda.is_available()


def test_never_on_the_cpu_nor_in_the_interpreter():
    assert not _common.use_pdl(torch.zeros(1))
    assert _common.launch_pdl(False) == {}
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert not _common.PDL_ENABLED


@dataclass
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    layers: int
    context: int
    block: int


CPU_SHAPE = Shape(hidden=64, heads=4, kv_heads=2, head_dim=16, inter=96, layers=2, context=40,
                  block=16)
GPU_SHAPE = Shape(hidden=1024, heads=16, kv_heads=8, head_dim=128, inter=3072, layers=12,
                  context=700, block=256)

TRITON = dict(norm_linear=norm_linear_triton, rope_store=qk_norm_rope_store_triton,
              attention=paged_decode_attention_triton, linear=skinny_linear_triton,
              down=lambda h, w: skinny_linear_triton(h, w, gated=True))
REFERENCE = dict(norm_linear=norm_linear_ref, rope_store=qk_norm_rope_store_ref,
                 attention=paged_decode_attention_ref, linear=F.linear,
                 down=lambda h, w: F.linear(silu_and_mul_ref(h), w))


def make_layers(s: Shape, device: str) -> tuple[list[dict], dict]:
    """Weights and a KV cache per layer (the context already stored), and the step's inputs:
    one token at position `context`."""
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device=device) * scale / shape[-1] ** 0.5

    blocks = -(-(s.context + 1) // s.block)
    layers = [dict(
        g1=1 + rand(s.hidden), w_qkv=rand((s.heads + 2 * s.kv_heads) * s.head_dim, s.hidden),
        qw=1 + rand(s.head_dim), kw=1 + rand(s.head_dim), w_o=rand(s.hidden, s.heads * s.head_dim),
        g2=1 + rand(s.hidden), w_gu=rand(2 * s.inter, s.hidden), w_down=rand(s.hidden, s.inter),
        k_cache=rand(blocks, s.block, s.kv_heads, s.head_dim, scale=s.head_dim ** 0.5),
        v_cache=rand(blocks, s.block, s.kv_heads, s.head_dim, scale=s.head_dim ** 0.5),
    ) for _ in range(s.layers)]
    as_int = dict(dtype=torch.int32, device=device)
    step = dict(positions=torch.tensor([s.context], **as_int),
                slots=torch.tensor([s.context], **as_int),
                table=torch.arange(blocks, **as_int)[None], seq_lens=torch.tensor([s.context + 1],
                                                                                 **as_int),
                cos_sin=build_rope_cache(s.head_dim, s.context + 1, 1e6, None, device))
    return layers, step


def decode_layers(x, layers, step, s: Shape, ops: dict):
    residual = x
    for layer in layers:
        qkv, residual = ops["norm_linear"](x, residual, layer["g1"], EPS, layer["w_qkv"])
        q = ops["rope_store"](qkv, s.heads, s.kv_heads, step["positions"], step["cos_sin"],
                              layer["qw"], layer["kw"], EPS, layer["k_cache"],
                              layer["v_cache"], step["slots"])
        attn = ops["attention"](q, layer["k_cache"], layer["v_cache"], step["table"],
                                step["seq_lens"], s.head_dim ** -0.5)
        x = ops["linear"](attn.reshape(1, -1), layer["w_o"])
        h, residual = ops["norm_linear"](x, residual, layer["g2"], EPS, layer["w_gu"])
        x = ops["down"](h, layer["w_down"])
    return x, residual


def with_fresh_caches(layers: list[dict]) -> list[dict]:
    return [dict(layer, k_cache=layer["k_cache"].clone(), v_cache=layer["v_cache"].clone())
            for layer in layers]


def test_the_decode_layers_equal_the_references_op_by_op():
    """The chain itself, eagerly (interpreted on the CPU)."""
    s = GPU_SHAPE if GPU else CPU_SHAPE
    device = "cuda" if GPU else "cpu"
    layers, step = make_layers(s, device)
    x = torch.randn(1, s.hidden, generator=torch.Generator(device).manual_seed(1), device=device)
    got = decode_layers(x, with_fresh_caches(layers), step, s, TRITON)
    want = decode_layers(x, with_fresh_caches(layers), step, s, REFERENCE)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs Hopper or later")
def test_a_graph_of_early_launched_decode_layers_equals_the_references():
    assert _common.use_pdl(torch.zeros(1, device="cuda")) == _common.PDL_ENABLED
    s = GPU_SHAPE
    layers, step = make_layers(s, "cuda")
    graph_layers = with_fresh_caches(layers)
    x = torch.zeros(1, s.hidden, device="cuda")
    decode_layers(x, with_fresh_caches(layers), step, s, TRITON)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, residual = decode_layers(x, graph_layers, step, s, TRITON)
    for seed in range(5):
        for mine, pristine in zip(graph_layers, layers):
            mine["k_cache"].copy_(pristine["k_cache"])
            mine["v_cache"].copy_(pristine["v_cache"])
        x.copy_(torch.randn(1, s.hidden, generator=torch.Generator("cuda").manual_seed(seed),
                            device="cuda"))
        graph.replay()
        want, want_res = decode_layers(x, with_fresh_caches(layers), step, s, REFERENCE)
        torch.testing.assert_close(out, want, rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(residual, want_res, rtol=1e-3, atol=1e-3)
