"""Speculative decoding in the workers: proposals (n-gram prompt lookup, or a draft model:
speculative.draft) and their verification (speculative.rejection for drafts drawn from q)."""

from gpu_workers.speculative.ngram import propose_ngram, propose_ngram_batch
from gpu_workers.speculative.verify import (
    SpecStep,
    accept_lengths,
    entry_proposals,
    prepare_proposals,
    settle_verified,
)

__all__ = ["SpecStep", "accept_lengths", "entry_proposals", "prepare_proposals", "propose_ngram",
           "propose_ngram_batch", "settle_verified"]
