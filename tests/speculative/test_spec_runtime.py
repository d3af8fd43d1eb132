"""Speculative decoding in one process: the real Scheduler and ModelRunner on a tiny model."""

from __future__ import annotations

from spec_helpers import generate, greedy_requests


def test_greedy_tokens_equal_without_speculation(tiny_qwen3_dir):
    reqs = greedy_requests(0)
    base, _, _ = generate(tiny_qwen3_dir, reqs)
    spec, sched, worker = generate(tiny_qwen3_dir, reqs, k=4)
    assert spec == base
    stats = sched.stats()
    assert stats.spec_proposed_tokens > 0 and stats.spec_accepted_tokens > 0
    # Fewer steps than tokens: some steps advanced a sequence by more than one token.
    assert any(r.num_tokens and max(r.num_tokens) > 1 for r in worker.results)
