"""Speculative sampling for proposals drawn from a draft distribution q.

A proposal d drawn from q at a position where the target gives p is accepted with probability
min(1, p(d) / q(d)); on rejection the token is drawn from norm(max(0, p - q)). The token that
comes out is distributed as p (Leviathan et al., Chen et al. 2023). p and q are the
distributions the sampler would draw from: temperature, top-k, top-p and min-p applied.

The outcome is returned as a draw per position, which is the proposal when it was accepted and
the residual sample otherwise; the residual is zero at d whenever d can be rejected (p(d) <
q(d)), so "draw == proposal" is exactly "accepted" and the verification of n-gram proposals
(gpu_workers.speculative.verify) settles these draws unchanged.
"""

from __future__ import annotations

import numpy as np
import torch

from gpu_workers.sampler import SamplingBatch, _thresholds
from gpu_workers.sequence_table import SequenceTable
from gpu_workers.transfer import to_device


def row_sampling(table: SequenceTable, rows: np.ndarray, device: torch.device) -> SamplingBatch:
    """The sampling parameters of mirror rows as a SamplingBatch (filters only: no seeds,
    penalties or logprobs, which speculative sampling does not read)."""
    temp, top_k = table.temperature[rows], table.top_k[rows]
    top_p, min_p = table.top_p[rows], table.min_p[rows]
    random_rows = temp > 0
    return SamplingBatch(
        temperature=to_device(temp, device), top_k=to_device(top_k, device),
        top_p=to_device(top_p, device), min_p=to_device(min_p, device),
        all_greedy=not random_rows.any(), any_greedy=not random_rows.all(),
        max_top_k=int(top_k[random_rows].max(initial=0)),
        use_top_p=bool(np.any(top_p[random_rows] < 1.0)),
        use_min_p=bool(np.any(min_p[random_rows] > 0.0)), seeded=[], logprobs=False)


def filtered_probs(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """[R, V] float32: the distribution the sampler draws from for rows with temperature > 0."""
    scores = logits.float() / b.temperature.clamp_min(1e-6)[:, None]
    tau = _thresholds(scores, b)
    if tau is not None:
        scores.masked_fill_(scores < tau[:, None], float("-inf"))
    return torch.softmax(scores, dim=-1)


def categorical(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """[R] int64 ids, row i drawn from probs[i] (unnormalised is fine): the exponential race."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def rejection_draws(p_logits: torch.Tensor, sampling: SamplingBatch, q: torch.Tensor,
                    proposals: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """[M] int64: per position, the proposal if accepted, else a draw from norm(max(0, p-q)).

    p_logits [M, V]: the target's logits at the positions that predict the proposals;
    q [M, V]: the draft distributions the proposals [M] were drawn from."""
    p = filtered_probs(p_logits, sampling)
    pd = p.gather(1, proposals[:, None]).squeeze(1)
    qd = q.gather(1, proposals[:, None]).squeeze(1)
    u = torch.rand(len(proposals), generator=generator, device=p.device)
    accept = u * qd < pd  # u < min(1, p/q) without dividing (qd > 0: d was drawn from q)
    residual = (p - q).clamp_min_(0.0)
    # p == q leaves no residual, but then every proposal is accepted: any row will do.
    residual = torch.where((residual.sum(dim=-1) > 0)[:, None], residual, p)
    return torch.where(accept, proposals, categorical(residual, generator))
