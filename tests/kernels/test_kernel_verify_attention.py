"""Decode attention with several queries per sequence (a step verifying speculative proposals):
Triton (interpreted on CPU) and the torch reference vs dense causal attention."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_decode_attention import (
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = dict(atol=1e-4, rtol=1e-4) if DEVICE == "cpu" else dict(atol=2e-2, rtol=2e-2)
HEADS = {"mha": (4, 4), "gqa2": (4, 2), "gqa3_padded": (6, 2)}


def _args(case: dict) -> tuple:
    return (case["q"], case["k_cache"], case["v_cache"], case["block_tables"],
            case["seq_lens_k"], case["scale"])


@pytest.mark.parametrize("q_per_seq", [2, 3, 5])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_verify_attention_matches_dense_causal(q_per_seq, heads, num_splits, paged_case,
                                               dense_attention):
    h, hkv = HEADS[heads]
    ctx = [0, 9, 21, 40]  # context before the step; the queries are the next q_per_seq
    case = paged_case([q_per_seq] * len(ctx), ctx, h, hkv, 16, 4)
    out = paged_decode_attention_triton(*_args(case), num_splits=num_splits, q_per_seq=q_per_seq)
    torch.testing.assert_close(out.double().cpu(), dense_attention(case), **TOL)
    ref = paged_decode_attention_ref(*_args(case), q_per_seq=q_per_seq)
    torch.testing.assert_close(ref.double().cpu(), dense_attention(case), **TOL)


def test_one_query_per_sequence_is_plain_decode(paged_case):
    case = paged_case([1, 1, 1], [0, 12, 40], 4, 2, 16, 4)
    torch.testing.assert_close(paged_decode_attention(*_args(case), q_per_seq=1),
                               paged_decode_attention_ref(*_args(case)), **TOL)


def test_padding_queries_leave_the_real_ones_alone(paged_case):
    """A sequence verifying fewer proposals than the launch's width is padded with queries
    whose outputs are ignored; its real queries must not see the padded positions."""
    q_per_seq = 4
    case = paged_case([q_per_seq, q_per_seq], [7, 30], 4, 2, 16, 4)
    out = paged_decode_attention(*_args(case), q_per_seq=q_per_seq)
    # The first two queries of sequence 0 as their own two-query step over 7 + 2 positions.
    short = dict(case, q=case["q"][:2], block_tables=case["block_tables"][:1],
                 seq_lens_k=case["seq_lens_k"][:1] - 2)
    alone = paged_decode_attention(*_args(short), q_per_seq=2)
    torch.testing.assert_close(out[:2], alone, **TOL)


def test_q_not_a_multiple_of_the_queries_per_sequence_is_refused(paged_case):
    case = paged_case([2, 2], [3, 4], 4, 2, 16, 4)
    with pytest.raises(ValueError, match="q_per_seq=3"):
        paged_decode_attention(*_args(case), q_per_seq=3)
