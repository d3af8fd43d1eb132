"""Verifying proposed tokens with one forward pass of the target model.

A speculating entry computes its last known token plus v proposed ones (v <= the plan's
num_spec cap), and the sampler draws one token at each of those 1 + v positions, each with the
distribution the model gives after the tokens before it. Proposal j is accepted while every
draw before it matched; the entry then produces the accepted proposals plus the draw at the
first mismatch (or the bonus draw after the last proposal): 1 + accepted tokens.

Why this is exact: an n-gram proposal is a point mass on d, and standard speculative
rejection sampling accepts d with probability p(d), else draws from p with d removed and
renormalised. Drawing x ~ p and accepting iff x == d is the same: P(accept) = p(d), and given
a rejection x is distributed as p without d, renormalised. Greedy is the temperature-0 case
(x = argmax), so greedy output equals decoding without speculation token for token. A seeded
request draws position j with the seed of its (generated + j)-th token, as it would without
speculation, so seeded output is identical too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpu_workers.batch import StepBatch
from gpu_workers.pending_step import PendingStep
from gpu_workers.sequence_table import SequenceTable
from gpu_workers.speculative.ngram import propose_ngram_batch


@dataclass(slots=True)
class SpecStep:
    """Proposals of one step, per entry (0 for entries that do not speculate)."""

    num_verify: np.ndarray
    """[entries] proposed tokens each entry verifies (written in the mirror past its tokens)."""
    spec_planned: np.ndarray
    """[entries] whether the plan let the entry speculate (num_spec > 0)."""


def prepare_proposals(table: SequenceTable, rows: np.ndarray, num_new: np.ndarray,
                      num_spec: np.ndarray, ngram_size: int) -> SpecStep:
    """Propose for every entry the plan lets speculate and that samples this step; write
    the proposals into the mirror just past its known tokens (num_tokens is unchanged, so
    they stay guesses until accepted). One batched search for all entries (no loop over
    sequences: at batch 256 that loop was host time on every step)."""
    num_verify = np.zeros(len(rows), np.int64)
    length = table.num_tokens[rows]
    live = np.flatnonzero((num_spec > 0) & (table.num_computed[rows] + num_new == length))
    if len(live) == 0:
        return SpecStep(num_verify, num_spec > 0)
    live_rows, live_len = rows[live], length[live]
    k = np.minimum(num_spec[live], table.max_tokens - live_len)
    proposals, counts = propose_ngram_batch(table.tokens, live_rows, live_len, k, ngram_size)
    # Row-major order of the kept proposals is the order of np.repeat over the rows.
    kept = np.arange(proposals.shape[1]) < counts[:, None]
    offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    table.tokens[np.repeat(live_rows, counts), np.repeat(live_len, counts) + offsets] = \
        proposals[kept]
    num_verify[live] = counts
    return SpecStep(num_verify, num_spec > 0)


def entry_proposals(table: SequenceTable, rows: np.ndarray, num_verify: np.ndarray
                    ) -> list[np.ndarray]:
    """Each entry's proposals: the num_verify[i] tokens in the mirror past row i's known ones."""
    lengths = table.num_tokens[rows]
    return [table.tokens[r, n:n + v] for r, n, v in
            zip(rows.tolist(), lengths.tolist(), num_verify.tolist(), strict=True)]


def accept_lengths(draws: np.ndarray, proposals: np.ndarray, num_verify: np.ndarray
                   ) -> np.ndarray:
    """Accepted proposals per sampling entry.

    draws: the flat draws, 1 + num_verify[i] per entry; proposals: the flat proposals,
    num_verify[i] per entry. Entry i accepts its first a proposals where a is the length of
    the longest prefix on which they equal the draws at the positions before them. One
    numpy pass, no loop over entries."""
    num_verify = np.asarray(num_verify, np.int64)
    entries = len(num_verify)
    entry = np.repeat(np.arange(entries), num_verify)
    # Entry i's draws start i places after its proposals (each entry has one extra draw).
    mismatch = draws[np.arange(len(proposals)) + entry] != proposals
    offset = np.arange(len(proposals)) - np.repeat(np.cumsum(num_verify) - num_verify,
                                                   num_verify)
    accepted = num_verify.copy()
    np.minimum.at(accepted, entry[mismatch], offset[mismatch])
    return accepted


def settle_verified(pending: PendingStep, batch: StepBatch, spec: SpecStep,
                    stream: torch.cuda.Stream | None) -> PendingStep:
    """Wait for a verification step's draws, keep each entry's accepted proposals and one
    draw, append them to the mirror and return the step settled, its host arrays flat.

    Every rank holds the same draws (rank 0 broadcast them) and the same proposals, so every
    rank's mirror accepts the same tokens. stream: where the step ran (None: the CPU)."""
    pending.copy_to_host(stream)
    pending.wait()
    table, rows = pending.table, pending.rows
    num_verify = spec.num_verify[batch.sample_entries]
    proposals = np.concatenate(entry_proposals(table, rows, num_verify)
                               or [np.zeros(0, np.int32)])
    draws = pending.host_tokens
    accepted = accept_lengths(draws, proposals, num_verify)
    counts = accepted + 1
    steps = np.arange(len(draws)) - np.repeat(np.cumsum(num_verify + 1) - num_verify - 1,
                                              num_verify + 1)
    keep = steps <= np.repeat(accepted, num_verify + 1)
    pending.host_tokens = draws[keep]
    for name in ("host_logprobs", "host_top_ids", "host_top_logprobs"):
        value = getattr(pending, name)
        if value is not None:
            setattr(pending, name, value[keep])
    table.append_verified(rows, counts, pending.host_tokens)
    pending.counts, pending.num_proposed = counts, num_verify
    pending.settled = True
    return pending
