"""Speculative decoding on the GPU: steps that verify proposals replay CUDA graphs (every
entry padded to 1 + K tokens), and greedy output stays that of decoding without speculation."""

from __future__ import annotations

import pytest
from spec_helpers import generate, greedy_requests

pytestmark = pytest.mark.gpu



def _cuda() -> dict:
    """float32 on the GPU, the KV pool sized from memory a little above what is in use."""
    import torch

    free, total = torch.cuda.mem_get_info()
    return dict(device="cuda", dtype="float32",
                gpu_memory_utilization=min(0.95, (total - free) / total + 0.05))


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    yield
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture
def replays(monkeypatch) -> dict[int, int]:
    """Graph replays counted by tokens per entry (1: decode, 1 + K: verify, 2: draft)."""
    from gpu_workers.decode_graphs import DecodeGraphs

    counts: dict[int, int] = {}
    run = DecodeGraphs.run

    def counted(self, *args):
        counts[self.q_per_seq] = counts.get(self.q_per_seq, 0) + 1
        return run(self, *args)

    monkeypatch.setattr(DecodeGraphs, "run", counted)
    return counts


@pytest.mark.parametrize("k", [2, 4])
def test_verify_graphs_keep_greedy_tokens(tiny_qwen3_dir, k, replays):
    reqs = greedy_requests(3, n=6)
    base, _, _ = generate(tiny_qwen3_dir, reqs, **_cuda())
    spec, sched, _ = generate(tiny_qwen3_dir, reqs, k=k, **_cuda())
    assert spec == base
    assert sched.stats().spec_accepted_tokens > 0
    assert replays.get(k + 1, 0) > 0  # verify steps ran as graphs


def test_draft_graphs_keep_greedy_tokens(tiny_qwen3_dir, replays):
    """The draft (here the target itself, so every proposal is accepted) replays its own
    graphs: two-token catch-up steps after a fully accepted step, one-token proposal steps."""
    reqs = greedy_requests(4, n=4)
    base, _, _ = generate(tiny_qwen3_dir, reqs, **_cuda())
    spec, sched, _ = generate(tiny_qwen3_dir, reqs, k=4, draft=tiny_qwen3_dir, **_cuda())
    assert spec == base
    stats = sched.stats()
    assert stats.spec_accepted_tokens == stats.spec_proposed_tokens > 0
    assert replays.get(2, 0) > 0 and replays.get(5, 0) > 0  # draft catch-up, target verify
