"""Speculative decoding in one process: the real Scheduler and ModelRunner on a tiny model."""

from __future__ import annotations

import random
from collections import Counter

from spec_helpers import generate, greedy_requests

from protocol import AddRequest, SamplingParams


def test_greedy_tokens_equal_without_speculation(tiny_qwen3_dir):
    reqs = greedy_requests(0)
    base, _, _ = generate(tiny_qwen3_dir, reqs)
    spec, sched, worker = generate(tiny_qwen3_dir, reqs, k=4)
    assert spec == base
    stats = sched.stats()
    assert stats.spec_proposed_tokens > 0 and stats.spec_accepted_tokens > 0
    # Fewer steps than tokens: some steps advanced a sequence by more than one token.
    assert any(r.num_tokens and max(r.num_tokens) > 1 for r in worker.results)


def test_prefix_hits_chunked_prefill_and_preemption_keep_greedy_tokens(tiny_qwen3_dir):
    """Shared prompt heads (prefix-cache hits), a 24-token budget (chunked prefill; proposals
    share that budget) and a 14-block pool (preemption) at once. The pool invariants are
    checked after every step (free + held = total, refcount = holders)."""
    reqs = greedy_requests(5, n=8)
    head = reqs[0].prompt_token_ids[:32]
    reqs = [r if i % 2 else type(r)(r.request_id, head + r.prompt_token_ids, r.params,
                                    r.eos_token_ids) for i, r in enumerate(reqs)]
    base, _, _ = generate(tiny_qwen3_dir, reqs)
    spec, sched, _ = generate(tiny_qwen3_dir, reqs, k=5, kv_bytes=14 * 16 * 512, budget=24)
    assert spec == base
    stats = sched.stats()
    assert stats.preemptions > 0 and stats.cached_prompt_tokens > 0
    assert stats.spec_accepted_tokens > 0
    assert stats.kv_blocks_used == 0


def test_seeded_sampling_equals_without_speculation(tiny_qwen3_dir):
    """A seeded draw at a verified position uses the seed of that token's index, so seeded
    random output does not depend on speculation."""
    reqs = greedy_requests(9, n=4, temperature=0.8, seed=1234, top_k=20)
    base, _, _ = generate(tiny_qwen3_dir, reqs)
    spec, sched, _ = generate(tiny_qwen3_dir, reqs, k=3)
    assert spec == base
    assert sched.stats().spec_proposed_tokens > 0


def test_first_sampled_tokens_follow_the_same_distribution(tiny_qwen3_dir):
    """temperature > 0, unseeded: the token sampled at the first verified position (accepted
    proposal or the draw that rejected it) follows the same distribution as without
    speculation. The prompt holds every ordinary token once, so a 1-gram lookup always
    proposes; chi-square on the counts, fixed sampler seeds."""
    from scipy.stats import chi2_contingency

    prompt = list(range(3, 680))  # the tiny vocabulary has 688 ids
    random.Random(4).shuffle(prompt)
    reqs = [AddRequest(i, prompt, SamplingParams(temperature=1.0, top_k=6, max_tokens=4,
                                                 ignore_eos=True), [2]) for i in range(300)]
    counts = []
    for k in (0, 2):
        out, sched, _ = generate(tiny_qwen3_dir, reqs, k=k, ngram=1, budget=1024, seed=k + 11,
                                 max_num_seqs=64, max_model_len=700, kv_bytes=8 << 20)
        if k:
            stats = sched.stats()
            assert 0 < stats.spec_accepted_tokens < stats.spec_proposed_tokens
        counts.append(Counter(toks[1] for toks, _ in out.values()))
    support = sorted(set(counts[0]) | set(counts[1]))
    # Pool rare tokens so that every expected count is large enough for the test.
    common = [t for t in support if counts[0][t] + counts[1][t] >= 20]
    rows = [[c[t] for t in common] + [sum(c[t] for t in support if t not in common)]
            for c in counts]
    p = chi2_contingency(rows)[1]
    assert p > 0.01, (p, rows)
