"""Draft-model speculative decoding in one process: the real Scheduler and ModelRunner with a
draft model loaded beside the target (tiny random models, CPU float32)."""

from __future__ import annotations

from collections import Counter

import pytest
from spec_helpers import generate, greedy_requests, truncate_model
from tiny_models import make_tiny_model

from protocol import AddRequest, SamplingParams


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory) -> str:
    """A different random model with the same vocabulary and one layer."""
    return str(make_tiny_model("qwen3", tmp_path_factory.mktemp("draft_1layer"), seed=7,
                               num_hidden_layers=1))


@pytest.fixture(scope="module")
def truncated_draft_dir(tiny_qwen3_dir, tmp_path_factory) -> str:
    """The target's first layer (with its embeddings, norm and head): a draft that agrees
    with the target on part of its tokens."""
    return str(truncate_model(tiny_qwen3_dir, tmp_path_factory.mktemp("draft_trunc"), 1))


def acceptance(sched) -> float:
    stats = sched.stats()
    assert stats.spec_proposed_tokens > 0
    return stats.spec_accepted_tokens / stats.spec_proposed_tokens


def test_target_as_its_own_draft_accepts_everything(tiny_qwen3_dir):
    reqs = greedy_requests(0)
    base, _, _ = generate(tiny_qwen3_dir, reqs)
    spec, sched, worker = generate(tiny_qwen3_dir, reqs, k=4, draft=tiny_qwen3_dir)
    assert spec == base
    assert acceptance(sched) > 0.97
    assert any(r.num_tokens and max(r.num_tokens) == 5 for r in worker.results)


def test_draft_kv_stays_consistent_through_prefix_hits_chunks_and_preemption(tiny_qwen3_dir):
    """Shared prompt heads (prefix-cache hits: the draft reuses its own KV of those blocks), a
    24-token budget (chunked prefill, which the draft catches up on) and a 14-block pool
    (preemption, re-sent sequences) at once. With the target as its own draft, stale or
    missing draft KV would show as rejected proposals: acceptance stays ~100%."""
    reqs = greedy_requests(5, n=8)
    head = reqs[0].prompt_token_ids[:32]
    reqs = [r if i % 2 else type(r)(r.request_id, head + r.prompt_token_ids, r.params,
                                    r.eos_token_ids) for i, r in enumerate(reqs)]
    base, _, _ = generate(tiny_qwen3_dir, reqs)
    spec, sched, _ = generate(tiny_qwen3_dir, reqs, k=3, kv_bytes=14 * 16 * 1024, budget=24,
                              draft=tiny_qwen3_dir)
    assert spec == base
    stats = sched.stats()
    assert stats.preemptions > 0 and stats.cached_prompt_tokens > 0
    assert acceptance(sched) > 0.97
    assert stats.kv_blocks_used == 0


def test_a_different_draft_keeps_greedy_tokens(tiny_qwen3_dir, other_draft_dir):
    reqs = greedy_requests(1)
    base, _, _ = generate(tiny_qwen3_dir, reqs)
    spec, sched, _ = generate(tiny_qwen3_dir, reqs, k=3, draft=other_draft_dir)
    assert spec == base
    assert acceptance(sched) < 0.5


def test_seeded_sampling_equals_without_speculation(tiny_qwen3_dir, truncated_draft_dir):
    """A seeded request gets the draft's argmax as proposals and the target's seeded draw at
    each verified position, so its output does not depend on speculation."""
    reqs = greedy_requests(9, n=4, temperature=0.8, seed=1234, top_k=20)
    base, _, _ = generate(tiny_qwen3_dir, reqs)
    spec, sched, _ = generate(tiny_qwen3_dir, reqs, k=3, draft=truncated_draft_dir)
    assert spec == base
    assert sched.stats().spec_accepted_tokens > 0


def test_sampled_tokens_follow_the_target_distribution(tiny_qwen3_dir, truncated_draft_dir):
    """temperature > 0, unseeded: proposals drawn from the draft's q, accepted with
    min(1, p/q), else replaced by a draw from norm(max(0, p - q)). The tokens at the first two
    verified positions follow the same distributions as without speculation (chi-square on
    the counts of 300 requests, fixed sampler seeds)."""
    from scipy.stats import chi2_contingency

    prompt = list(range(40, 60))
    reqs = [AddRequest(i, prompt, SamplingParams(temperature=1.0, top_k=8, max_tokens=4,
                                                 ignore_eos=True), [2]) for i in range(300)]
    counts = {1: [], 2: []}
    for k in (0, 3):
        out, sched, _ = generate(tiny_qwen3_dir, reqs, k=k, budget=1024, seed=k + 11,
                                 max_num_seqs=64, kv_bytes=8 << 20, draft=truncated_draft_dir)
        if k:
            stats = sched.stats()
            assert 0 < stats.spec_accepted_tokens < stats.spec_proposed_tokens
        for pos in counts:
            counts[pos].append(Counter(toks[pos] for toks, _ in out.values()))
    for pos, (c0, c1) in counts.items():
        support = sorted(set(c0) | set(c1))
        common = [t for t in support if c0[t] + c1[t] >= 20]
        rows = [[c[t] for t in common] + [sum(c[t] for t in support if t not in common)]
                for c in (c0, c1)]
        p = chi2_contingency(rows)[1]
        assert p > 0.01, (pos, p, rows)
