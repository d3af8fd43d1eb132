"""Decode attention with all kv heads of a sequence in one program (the packed kernel):
Triton (interpreted on CPU) against the torch reference and against the per-kv-head kernel."""

from __future__ import annotations

import importlib
import os
import types

import numpy as np
import pytest
import torch

from kernels.paged_decode_attention import (
    paged_decode_attention_ref,
    paged_decode_attention_triton,
)

# The module, not the function of the same name that the kernels package exports.
pda = importlib.import_module("kernels.paged_decode_attention")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = dict(atol=1e-4, rtol=1e-4) if DEVICE == "cpu" else dict(atol=2e-2, rtol=2e-2)
BF16 = dict(atol=2e-2, rtol=2e-2)
# (q heads, kv heads, head dim): SmolLM2's grouping, and widths kv_heads * head_dim of
# 48, 80 and 96 columns, padded to 64 and 128.
HEADS = {"smollm2_like": (9, 3, 16), "five_kv": (10, 5, 16), "mha_six": (6, 6, 16)}
# Uneven contexts: empty (a padded batch slot), shorter than one 16-key tile, one tile and
# a bit, several tiles.
CONTEXTS = [0, 5, 17, 70, 129]


@pytest.fixture(autouse=True)
def bfloat16_dots(monkeypatch):
    """The interpreter holds bfloat16 values as their uint16 bits (numpy has no bfloat16) and
    multiplies those bits in `tl.dot`: widen the operands to float32 first, exactly, as the
    tensor cores read them."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    bits_dot = builder.create_dot

    def widen(x):
        if x.dtype != tl.bfloat16:
            return x
        wide = (x.data.astype(np.uint32) << np.uint32(16)).view(np.float32)
        return interpreter.TensorHandle(wide, tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return bits_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(builder, "create_dot", create_dot)


def _args(case: dict) -> tuple:
    return (case["q"], case["k_cache"], case["v_cache"], case["block_tables"],
            case["seq_lens_k"], case["scale"])


def _ref(case: dict, q_per_seq: int = 1) -> torch.Tensor:
    """The reference in float32 on the case's (possibly 16-bit) values."""
    args = [t.float() if t.is_floating_point() else t for t in _args(case)[:5]]
    return paged_decode_attention_ref(*args, case["scale"], q_per_seq=q_per_seq)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_packed_matches_ref_over_uneven_contexts(heads, num_splits, paged_case):
    h, hkv, d = HEADS[heads]
    case = paged_case([1] * len(CONTEXTS), CONTEXTS, h, hkv, d, 4)
    case["seq_lens_k"][0] = 0  # the padded slot holds no key at all
    out = paged_decode_attention_triton(*_args(case), num_splits=num_splits, packed=True)
    ref = _ref(case)
    assert torch.all(out[0] == 0) and torch.all(ref[0] == 0)
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("block_size", [4, 16, 32])
def test_packed_tiles_within_and_across_cache_blocks(block_size, paged_case):
    """A tile reads one cache block (block_size >= tile) or several, with one block-table
    read or one per key."""
    case = paged_case([1] * 4, [3, 40, 77, 16], 9, 3, 16, block_size)
    for splits in (1, 2):
        out = paged_decode_attention_triton(*_args(case), num_splits=splits, packed=True)
        torch.testing.assert_close(out, _ref(case), **TOL)


@pytest.mark.parametrize("heads", ["smollm2_like", "five_kv"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_packed_verifies_three_queries_causally(heads, num_splits, paged_case,
                                                dense_attention):
    h, hkv, d = HEADS[heads]
    q_per_seq = 3
    case = paged_case([q_per_seq] * 4, [0, 9, 21, 40], h, hkv, d, 4)
    out = paged_decode_attention_triton(*_args(case), num_splits=num_splits,
                                        q_per_seq=q_per_seq, packed=True)
    torch.testing.assert_close(out, _ref(case, q_per_seq), **TOL)
    on_cpu = {k: v.cpu() if torch.is_tensor(v) else v for k, v in case.items()}
    torch.testing.assert_close(out.double().cpu(), dense_attention(on_cpu), **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_packed_keeps_the_input_dtype(dtype, num_splits, paged_case):
    case = paged_case([1] * len(CONTEXTS), CONTEXTS, 9, 3, 16, 4, dtype=dtype)
    out = paged_decode_attention_triton(*_args(case), num_splits=num_splits, packed=True)
    assert out.dtype == dtype
    tol = TOL if dtype == torch.float32 else BF16
    torch.testing.assert_close(out.float(), _ref(case), **tol)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("q_per_seq,num_splits", [(1, 4), (3, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_and_per_head_kernels_agree(heads, q_per_seq, num_splits, dtype, paged_case):
    h, hkv, d = HEADS[heads]
    case = paged_case([q_per_seq] * len(CONTEXTS), CONTEXTS, h, hkv, d, 4, dtype=dtype, seed=1)
    kw = dict(num_splits=num_splits, q_per_seq=q_per_seq)
    packed = paged_decode_attention_triton(*_args(case), packed=True, **kw)
    per_head = paged_decode_attention_triton(*_args(case), packed=False, **kw)
    tol = TOL if dtype == torch.float32 else BF16
    torch.testing.assert_close(packed.float(), per_head.float(), **tol)
    torch.testing.assert_close(packed.float(), _ref(case, q_per_seq), **tol)


def test_packed_reads_strided_q_and_an_interleaved_kv_cache(paged_case):
    """q as a slice of a fused qkv output; K and V as halves of one cache tensor, so a
    token's row and a block are strided wider than the heads they hold."""
    case = paged_case([1] * 3, [6, 33, 50], 9, 3, 16, 8)
    t, h, d = case["q"].shape
    qkv = torch.randn(t, h + 6, d, device=case["q"].device)
    qkv[:, :h] = case["q"]
    kv = torch.stack([case["k_cache"], case["v_cache"]], 2)  # [blocks, bs, 2, kv heads, d]
    strided = dict(case, q=qkv[:, :h], k_cache=kv[:, :, 0], v_cache=kv[:, :, 1])
    out = paged_decode_attention_triton(*_args(strided), num_splits=2, packed=True)
    torch.testing.assert_close(out, _ref(case), **TOL)


def test_the_automatic_rule_packs_only_small_kv_heads():
    assert pda._use_packed(3, 64)  # SmolLM2-135M
    assert pda._use_packed(2, 16)
    assert not pda._use_packed(8, 128)  # Qwen3-0.6B
    assert not pda._use_packed(1, 128)
    assert not pda._use_packed(5, 64)  # 320 columns


def test_splits_count_sequences_as_programs_when_packed(monkeypatch):
    """With 132 SMs the launch wants ~528 programs: 32 sequences of 3 kv heads make 96 per
    split without packing (6 splits), 32 with it (17 splits); both capped by the tiles."""
    monkeypatch.setattr(pda, "_num_sms", lambda index: 132)
    q = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    assert pda._choose_splits(q, 32, 3, 4096, 64) == 6
    assert pda._choose_splits(q, 32, 3, 4096, 64, packed=True) == 17
    assert pda._choose_splits(q, 32, 3, 640, 64, packed=True) == 10
