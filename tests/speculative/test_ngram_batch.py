"""The batched n-gram proposer against the per-sequence reference (propose_ngram),
prepare_proposals writing the same proposals into the mirror as a loop over sequences would,
and accept_lengths against the per-entry loop it replaced."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_workers.sequence_table import SequenceTable
from gpu_workers.speculative import (
    accept_lengths,
    prepare_proposals,
    propose_ngram,
    propose_ngram_batch,
)

MAX_TOKENS = 64


@st.composite
def token_rows(draw):
    """Rows of a small vocabulary (so n-grams recur), with lengths, caps and a window."""
    num = draw(st.integers(1, 8))
    vocab = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (num + 2, MAX_TOKENS)).astype(np.int32)
    rows = rng.permutation(num + 2)[:num]
    lengths = np.array(draw(st.lists(st.integers(0, MAX_TOKENS), min_size=num, max_size=num)))
    k = np.array(draw(st.lists(st.integers(0, 6), min_size=num, max_size=num)))
    n = draw(st.integers(1, 4))
    window = draw(st.sampled_from([2, 5, 16, 40, 4096]))
    return tokens, rows, lengths, k, n, window


def reference(history: np.ndarray, n: int, k: int, min_n: int) -> np.ndarray:
    """propose_ngram with n, then n - 1, ... down to min_n until one proposes something."""
    for m in range(n, min_n - 1, -1):
        guess = propose_ngram(history, m, k)
        if len(guess):
            return guess
    return guess


@settings(max_examples=400, deadline=None)
@given(token_rows(), st.integers(1, 4))
def test_batch_equals_the_reference_per_row(case, min_n):
    tokens, rows, lengths, k, n, window = case
    min_n = min(min_n, n)
    proposals, counts = propose_ngram_batch(tokens, rows, lengths, k, n, window, min_n)
    for i, row in enumerate(rows):
        length = int(lengths[i])
        want = reference(tokens[row, max(0, length - window):length], n, int(k[i]), min_n)
        assert proposals[i, :counts[i]].tolist() == want.tolist(), (i, want, proposals[i])


def test_a_known_history_proposes_the_most_recent_full_continuation():
    tokens = np.array([[5, 1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3, 4, 1, 2, 3]], np.int32)
    proposals, counts = propose_ngram_batch(tokens, np.array([0]), np.array([18]),
                                            np.array([3]), 3)
    assert proposals[0, :counts[0]].tolist() == [4, 1, 2]  # after the occurrence at 11
    proposals, counts = propose_ngram_batch(tokens, np.array([0]), np.array([18]),
                                            np.array([6]), 3)
    assert proposals[0, :counts[0]].tolist() == [7, 8, 1, 2, 3, 4]  # occurrence at 6
    # None with 7 tokens after it: the earliest occurrence, the longest continuation.
    proposals, counts = propose_ngram_batch(tokens, np.array([0]), np.array([18]),
                                            np.array([30]), 3)
    assert proposals[0, :counts[0]].tolist() == tokens[0, 4:].tolist()


def test_no_rows_and_no_room_propose_nothing():
    tokens = np.zeros((2, 8), np.int32)
    proposals, counts = propose_ngram_batch(tokens, np.zeros(0, np.int64),
                                            np.zeros(0, np.int64), np.zeros(0, np.int64), 2)
    assert counts.shape == (0,)
    proposals, counts = propose_ngram_batch(tokens, np.array([0, 1]), np.array([8, 2]),
                                            np.array([0, 4]), 2)
    assert counts.tolist() == [0, 0]


@settings(max_examples=100, deadline=None)
@given(token_rows(), st.integers(0, 2**31))
def test_prepare_proposals_writes_what_the_per_sequence_loop_would(case, seed):
    tokens, rows, lengths, k, n, _ = case
    rng = np.random.default_rng(seed)
    table = SequenceTable(len(tokens), MAX_TOKENS, 4)
    table.tokens[:] = tokens
    table.num_tokens[rows] = lengths
    # Entries that sample this step end at the row's length; the others stop short of it.
    num_new = np.ones(len(rows), np.int64)
    short = rng.random(len(rows)) < 0.25
    table.num_computed[rows] = np.maximum(lengths - num_new - short, 0)
    expect = tokens.copy()
    want_verify = []
    for i, row in enumerate(rows):
        length = int(lengths[i])
        samples = table.num_computed[row] + num_new[i] == length
        cap = min(int(k[i]), MAX_TOKENS - length)
        guess = propose_ngram(tokens[row, :length], n, cap) if samples and k[i] > 0 else []
        expect[row, length:length + len(guess)] = guess
        want_verify.append(len(guess))
    spec = prepare_proposals(table, rows, num_new, k, n)
    assert spec.num_verify.tolist() == want_verify
    assert spec.spec_planned.tolist() == (k > 0).tolist()
    assert (table.tokens == expect).all()


def accept_lengths_loop(draws, proposals, num_verify) -> list[int]:
    """The per-entry loop accept_lengths replaced, as the reference."""
    accepted, d, p = [], 0, 0
    for v in num_verify:
        same = draws[d:d + v] == proposals[p:p + v]
        accepted.append(v if same.all() else int(np.argmin(same)))
        d, p = d + v + 1, p + v
    return accepted


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=12), st.integers(0, 2**31))
def test_accept_lengths_equals_the_per_entry_loop(num_verify, seed):
    rng = np.random.default_rng(seed)
    proposals = rng.integers(0, 3, sum(num_verify))
    draws = rng.integers(0, 3, sum(num_verify) + len(num_verify))
    got = accept_lengths(draws, proposals, np.array(num_verify, np.int64))
    assert got.tolist() == accept_lengths_loop(draws, proposals, num_verify)
