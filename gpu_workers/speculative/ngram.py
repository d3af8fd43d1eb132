"""N-gram (prompt-lookup) proposer: guess the next tokens by copying what followed the last
n tokens the previous time they occurred in the sequence.

Why in the worker: every rank mirrors each running sequence's tokens (gpu_workers.mirror), so
proposing there costs the plan nothing (the scheduler sends only a per-entry cap, num_spec),
and every rank of a tensor-parallel group proposes the same tokens from the same mirror, with
no extra message. The scheduler never learns the proposals, only how many were accepted.
"""

from __future__ import annotations

import numpy as np


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
