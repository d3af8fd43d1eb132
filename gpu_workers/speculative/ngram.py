"""N-gram (prompt-lookup) proposer: guess the next tokens by copying what followed the last
n tokens the previous time they occurred in the sequence.

Why in the worker: every rank holds each running sequence's tokens (gpu_workers.sequence_table);
proposing there costs the plan nothing (the scheduler sends only a per-entry cap, num_spec),
and every rank of a tensor-parallel group proposes the same tokens from the same mirror, with
no extra message. The scheduler never learns the proposals, only how many were accepted.

Why batched: at batch 256 a Python loop over sequences is host time on every step, so
`propose_ngram_batch` searches every row in one pass of numpy over a right-aligned window of
the mirror's token matrix; `propose_ngram` is the same rule for one sequence, kept as the
reference the tests compare against.
"""

from __future__ import annotations

import numpy as np

SEARCH_WINDOW = 4096
"""Proposals are looked up in a sequence's last SEARCH_WINDOW tokens only: bounds the work
of a step (rows x window) whatever the sequences' lengths."""


def propose_ngram(tokens: np.ndarray, n: int, k: int) -> np.ndarray:
    """Up to k tokens that followed an earlier occurrence of the last n tokens.

    Empty when the history is shorter than n + 1 or the n-gram never occurred before.
    The search is one vectorised comparison over the history: O(len * n) per sequence."""
    length = len(tokens)
    if k <= 0 or length <= n:
        return tokens[:0]
    tail = tokens[length - n:]
    # Candidate start i matches when tokens[i:i+n] == tail, for i + n < length (an earlier
    # occurrence with at least one token after it).
    windows = np.lib.stride_tricks.sliding_window_view(tokens[:length - 1], n)
    hits = np.flatnonzero((windows == tail).all(axis=1))
    if len(hits) == 0:
        return tokens[:0]
    # The most recent occurrence that still has k tokens after it; failing that, the
    # earliest (the longest continuation).
    full = hits[hits + n + k <= length]
    start = int(full[-1] if len(full) else hits[0]) + n
    return tokens[start:min(start + k, length)].copy()


def propose_ngram_batch(tokens: np.ndarray, rows: np.ndarray, lengths: np.ndarray,
                        k: np.ndarray, n: int, window: int = SEARCH_WINDOW, min_n: int | None = None
                        ) -> tuple[np.ndarray, np.ndarray]:
    """propose_ngram for many sequences at once, each over its last `window` tokens; with
    min_n < n, rows that the n-gram finds nothing for try n - 1, and so on down to min_n.

    tokens: the [capacity, max_tokens] token matrix; row rows[i] holds lengths[i] tokens and
    may take up to k[i] proposals. Returns (proposals [len(rows), max(k)], counts): row i's
    proposals are proposals[i, :counts[i]], equal to
    propose_ngram(tokens[rows[i], max(0, lengths[i] - window):lengths[i]], n, k[i])."""
    kmax = int(k.max()) if len(rows) else 0
    proposals, counts = _search(tokens, rows, lengths, k, n, window, kmax)
    for m in range(n - 1, (n if min_n is None else min_n) - 1, -1):
        retry = np.flatnonzero(counts == 0)
        if len(retry) == 0 or m < 1:
            break
        more, more_counts = _search(tokens, rows[retry], lengths[retry], k[retry], m, window,
                                   kmax)
        proposals[retry], counts[retry] = more, more_counts
    return proposals, counts


def _search(tokens: np.ndarray, rows: np.ndarray, lengths: np.ndarray, k: np.ndarray, n: int,
            window: int, kmax: int) -> tuple[np.ndarray, np.ndarray]:
    """propose_ngram_batch for one n, its proposals kmax wide."""
    num = len(rows)
    counts = np.zeros(num, np.int64)
    if num == 0 or kmax <= 0 or n < 1:
        return np.zeros((num, max(kmax, 0)), tokens.dtype), counts
    lengths = lengths.astype(np.int64)
    width = int(min(window, lengths.max()))
    if width <= n:
        return np.zeros((num, kmax), tokens.dtype), counts
    # Right-aligned: column width - 1 is every row's newest token; row i's history starts at
    # column width - seen[i] (earlier columns are padding, never matched). One flat gather.
    seen = np.minimum(lengths, width)
    stride = tokens.shape[1]
    index = (rows * stride + lengths - width)[:, None] + np.arange(width)
    seg = np.take(tokens.reshape(-1), index, mode="clip")
    # Candidate start c matches when seg[c:c+n] equals the row's last n tokens, c + n < width
    # (an earlier occurrence with at least one token after it), and c is inside the history.
    span = width - n
    match = seg[:, :span] == seg[:, width - n, None]
    for j in range(1, n):
        match &= seg[:, j:j + span] == seg[:, width - n + j, None]
    if (seen < width).any():
        match &= np.arange(span) >= (width - seen)[:, None]
    match &= ((k > 0) & (seen > n))[:, None]
    found = match.any(axis=1)
    # The most recent occurrence that still has k tokens after it (c + n + k <= width); failing
    # that, the earliest (the longest continuation).
    limit = width - n - k  # the last start with k tokens after it
    if (k == k[0]).all():
        full = match[:, :max(int(limit[0]) + 1, 0)]
    else:
        full = match & (np.arange(span) <= limit[:, None])
    has_full = full.any(axis=1)
    last_full = (full.shape[1] - 1 - np.argmax(full[:, ::-1], axis=1) if full.shape[1]
                 else np.zeros(num, np.int64))
    first = np.argmax(match, axis=1)
    start = np.where(has_full, last_full, first) + n
    counts = np.where(found, np.minimum(k, width - start), 0)
    take = np.minimum(start[:, None] + np.arange(kmax), width - 1)
    proposals = np.take_along_axis(seg, take, axis=1)
    return proposals, counts
