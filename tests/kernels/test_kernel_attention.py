"""Paged attention: Triton (interpreted on CPU) vs the torch reference vs dense attention."""

from __future__ import annotations

import importlib

import pytest
import torch

from kernels.paged_attention import paged_attention, paged_attention_ref, paged_attention_triton
from kernels.paged_decode_attention import (
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
)

decode_attention = importlib.import_module("kernels.paged_decode_attention")
"""The module (the package exports its function under the same name)."""
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# On a GPU the reference is torch SDPA's own CUDA kernels; test_kernel_fp32_precision.py
# holds the float32 kernels to float64 there.
TOL = dict(atol=1e-4, rtol=1e-4) if DEVICE == "cpu" else dict(atol=2e-2, rtol=2e-2)

# (q_lens, ctx_lens): ctx = cached prefix before this step; seq_len_k = ctx + q_len.
BATCHES = {
    "prefill": ([7, 20], [0, 0]),
    "ragged_mixed": ([5, 1, 17, 0, 3], [0, 9, 3, 4, 30]),
    "decode_only": ([1, 1, 1], [0, 12, 40]),
}
HEADS = {"mha": (4, 4), "gqa2": (4, 2), "gqa3_padded": (6, 2), "gqa4": (8, 2)}


def decode_args(case: dict) -> tuple:
    return (case["q"], case["k_cache"], case["v_cache"], case["block_tables"],
            case["seq_lens_k"], case["scale"])


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_attention_triton_matches_ref(batch, heads, block_size, paged_case):
    (q_lens, ctx_lens), (h, hkv) = BATCHES[batch], HEADS[heads]
    case = paged_case(q_lens, ctx_lens, h, hkv, 16, block_size)
    torch.testing.assert_close(paged_attention_triton(**case), paged_attention_ref(**case), **TOL)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("heads", ["mha", "gqa2", "gqa3_padded"])
def test_paged_attention_ref_matches_dense(batch, heads, paged_case, dense_attention):
    (q_lens, ctx_lens), (h, hkv) = BATCHES[batch], HEADS[heads]
    case = paged_case(q_lens, ctx_lens, h, hkv, 32, 4, device="cpu")
    ref = paged_attention_ref(**case)
    torch.testing.assert_close(ref.double().cpu(), dense_attention(case), atol=1e-5, rtol=1e-5)


def test_paged_attention_head_dim_32_and_fp16(paged_case):
    case = paged_case([9, 2], [5, 20], 4, 2, 32, 8, dtype=torch.float16)
    out = paged_attention_triton(**case)
    assert out.dtype == torch.float16
    ref = paged_attention_ref(**{**case, "q": case["q"].float(),
                                 "k_cache": case["k_cache"].float(),
                                 "v_cache": case["v_cache"].float()})
    tol = dict(atol=2e-3, rtol=2e-3) if DEVICE == "cpu" else TOL
    torch.testing.assert_close(out.float(), ref, **tol)


def test_paged_attention_noncontiguous_q(paged_case):
    case = paged_case([6, 3], [2, 0], 4, 2, 16, 4)
    t, h, d = case["q"].shape
    qkv = torch.randn(t, h + 4, d, device=case["q"].device)
    qkv[:, :h] = case["q"]
    out = paged_attention_triton(**{**case, "q": qkv[:, :h]})
    torch.testing.assert_close(out, paged_attention_ref(**case), **TOL)


@pytest.mark.parametrize("heads_first", [False, True])
@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("heads", ["mha", "gqa2", "gqa3_padded"])
def test_decode_triton_split_k_matches_ref(num_splits, heads, heads_first, paged_case,
                                           monkeypatch):
    """Either grid order (a sequence's kv heads side by side, or one head of neighbouring
    sequences: kernels.decode_launch.heads_first) indexes the same partials and outputs."""
    monkeypatch.setattr(decode_attention, "heads_first", lambda head_dim: heads_first)
    h, hkv = HEADS[heads]
    # Contexts span several splits, one split only, and a zero-length (padding) sequence.
    case = paged_case([1] * 5, [0, 9, 70, 129, 33], h, hkv, 16, 4)
    args = decode_args(case)
    out = paged_decode_attention_triton(*args, num_splits=num_splits)
    torch.testing.assert_close(out, paged_decode_attention_ref(*args), **TOL)


@pytest.mark.parametrize("block_n", [32, 64])
def test_decode_tiles_wider_than_a_block_match_ref(block_n, paged_case):
    """block_n, the benchmark's knob: tiles of several 16-token blocks, split or not."""
    case = paged_case([1] * 4, [0, 9, 70, 129], 9, 3, 16, 4)  # SmolLM2's 3 q heads a kv head
    args = decode_args(case)
    for splits in (1, 3):
        out = paged_decode_attention_triton(*args, num_splits=splits, block_n=block_n)
        torch.testing.assert_close(out, paged_decode_attention_ref(*args), **TOL)
    with pytest.raises(ValueError, match="power of two"):
        paged_decode_attention_triton(*args, block_n=48)


def test_decode_split_k_with_max_seqlen_and_empty_sequence(paged_case):
    case = paged_case([1] * 3, [40, 0, 17], 4, 2, 16, 16)
    case["seq_lens_k"][1] = 0  # a padded batch slot
    args = decode_args(case)
    out = paged_decode_attention_triton(*args, max_seqlen_k=41, num_splits=4)
    ref = paged_decode_attention_ref(*args)
    assert torch.all(ref[1] == 0) and torch.all(out[1] == 0)
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("num_splits", [4, 16, 20, 64])
def test_decode_short_contexts_in_a_wide_table_fill_every_split(num_splits, paged_case):
    """A decode graph sizes the launch for max_model_len: each sequence divides its own length
    among the splits, so contexts far shorter than the table, of one tile or of several, and
    splits with no keys at all, all give the reference's result. The reduce merges its
    partials REDUCE_CHUNK at a time: 20 and 64 splits take it over several chunks, some of
    them empty for the shorter contexts."""
    case = paged_case([1] * 5, [0, 15, 47, 90, 700], 4, 2, 16, 4)
    wide = torch.full((5, 512), -1, dtype=torch.int32, device=case["block_tables"].device)
    wide[:, :case["block_tables"].shape[1]] = case["block_tables"]
    args = (*decode_args(case)[:3], wide, *decode_args(case)[4:])
    out = paged_decode_attention_triton(*args, num_splits=num_splits)
    torch.testing.assert_close(out, paged_decode_attention_ref(*args), **TOL)


@pytest.mark.parametrize("heads", ["mha", "gqa4"])
def test_decode_ref_matches_unified_and_dense(heads, paged_case, dense_attention):
    h, hkv = HEADS[heads]
    case = paged_case([1] * 4, [0, 5, 31, 64], h, hkv, 32, 4, device="cpu")
    out = paged_decode_attention_ref(*decode_args(case))
    torch.testing.assert_close(out, paged_attention_ref(**case), **TOL)
    torch.testing.assert_close(out.double().cpu(), dense_attention(case), atol=1e-5, rtol=1e-5)


def test_dispatch_uses_ref_on_cpu_and_triton_on_cuda(paged_case):
    case = paged_case([3, 1], [2, 6], 4, 2, 16, 4)
    out = paged_attention(**case)
    torch.testing.assert_close(out, paged_attention_ref(**case), **TOL)
    case = paged_case([1, 1], [2, 6], 4, 2, 16, 4)
    out = paged_decode_attention(*decode_args(case))
    torch.testing.assert_close(out, paged_decode_attention_ref(*decode_args(case)), **TOL)
    assert out.device.type == DEVICE


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda c: c.update(q=c["q"][:, :3]), "multiple of num kv heads"),
        (lambda c: c.update(block_tables=c["block_tables"].long()), "block_tables must be int32"),
        (lambda c: c.update(seq_lens_k=c["seq_lens_k"][:1]), "seq_lens_k must be"),
        (lambda c: c.update(cu_seqlens_q=c["cu_seqlens_q"].long()), "cu_seqlens_q must be int32"),
        (lambda c: c.update(v_cache=c["v_cache"][:, :2]), "alike"),
        (lambda c: c.update(q=c["q"][..., :12]), "head_dim"),
    ],
)
def test_paged_attention_rejects_bad_inputs(change, match, paged_case):
    case = paged_case([3, 1], [2, 6], 4, 2, 16, 4)
    change(case)
    for fn in (paged_attention_triton, paged_attention_ref):
        with pytest.raises(ValueError, match=match):
            fn(**case)


def test_triton_rejects_noncontiguous_head_dim(paged_case):
    case = paged_case([3], [2], 4, 2, 16, 4)
    q = case["q"].transpose(0, 2).contiguous().transpose(0, 2)
    with pytest.raises(ValueError, match="contiguous in head_dim"):
        paged_attention_triton(**{**case, "q": q})
