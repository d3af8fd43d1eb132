"""Draft-model speculative decoding in one process: the real Scheduler and ModelRunner with a
draft model loaded beside the target (tiny random models, CPU float32)."""

from __future__ import annotations

import pytest
from spec_helpers import generate, greedy_requests
from tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory) -> str:
    """A different random model with the same vocabulary and one layer."""
    return str(make_tiny_model("qwen3", tmp_path_factory.mktemp("draft_1layer"), seed=7,
                               num_hidden_layers=1))


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


def test_a_different_draft_keeps_greedy_tokens(tiny_qwen3_dir, other_draft_dir):
    reqs = greedy_requests(1)
    base, _, _ = generate(tiny_qwen3_dir, reqs)
    spec, sched, _ = generate(tiny_qwen3_dir, reqs, k=3, draft=other_draft_dir)
    assert spec == base
    assert acceptance(sched) < 0.5
