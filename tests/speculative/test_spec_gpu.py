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


@pytest.mark.parametrize("k", [2, 4])
def test_verify_graphs_keep_greedy_tokens(tiny_qwen3_dir, k, monkeypatch):
    from gpu_workers.cuda_graphs import DecodeGraphs

    replays = {1: 0, k + 1: 0}
    run = DecodeGraphs.run

    def counted(self, batch, bs):
        replays[self.q_per_seq] += 1
        return run(self, batch, bs)

    monkeypatch.setattr(DecodeGraphs, "run", counted)
    reqs = greedy_requests(3, n=6)
    base, _, _ = generate(tiny_qwen3_dir, reqs, **_cuda())
    replays[1] = 0
    spec, sched, _ = generate(tiny_qwen3_dir, reqs, k=k, **_cuda())
    assert spec == base
    assert sched.stats().spec_accepted_tokens > 0
    assert replays[k + 1] > 0  # verify steps ran as graphs
