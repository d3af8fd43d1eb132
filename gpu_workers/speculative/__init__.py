"""Speculative decoding in the workers: proposals (n-gram prompt lookup) and verification."""

from gpu_workers.speculative.ngram import propose_ngram
from gpu_workers.speculative.verify import (
    SpecStep,
    accept_lengths,
    prepare_proposals,
    settle_verified,
)

__all__ = ["SpecStep", "accept_lengths", "prepare_proposals", "propose_ngram",
           "settle_verified"]
