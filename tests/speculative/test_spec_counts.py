"""The engine's proposal counts when speculating steps verify nothing (their StepResult
carries num_tokens but num_proposed None) and when they verify proposals: the scheduler's
EngineStats equal what the worker reported, and greedy tokens equal no speculation."""

from __future__ import annotations

from spec_helpers import generate

from protocol import AddRequest, SamplingParams


def test_steps_without_proposals_count_none_and_the_rest_add_up(tiny_qwen3_dir):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    distinct = list(range(10, 40))  # no 3-gram of the prompt recurs: the first steps find none
    reqs = [AddRequest(0, distinct, params, [2]), AddRequest(1, [5, 6, 7] * 8, params, [2])]
    base, _, _ = generate(tiny_qwen3_dir, reqs, ngram=3)
    spec, sched, worker = generate(tiny_qwen3_dir, reqs, k=4, ngram=3)
    assert spec == base
    speculative = [r for r in worker.results if r.num_tokens is not None]
    assert any(r.num_proposed is None for r in speculative)
    assert any(r.num_proposed is not None for r in speculative)
    stats = sched.stats()
    assert stats.spec_proposed_tokens == sum(sum(r.num_proposed or []) for r in speculative)
    assert stats.spec_accepted_tokens == sum(sum(r.num_tokens) - len(r.num_tokens)
                                             for r in speculative)
