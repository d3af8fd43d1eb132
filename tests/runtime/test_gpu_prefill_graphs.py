"""Prefill CUDA graphs: a step of a few prompts replays a captured graph (padded to its
bucket) and gives the tokens eager execution gives."""

from __future__ import annotations

import pytest
from random_prompts import random_prompts
from rt_helpers import BLOCK_SIZE, make_runner
from rt_planner import Planner

pytestmark = pytest.mark.gpu


def _runner(model_dir, **kw):
    import torch

    free, total = torch.cuda.mem_get_info()
    return make_runner(model_dir, **{"device": "cuda", "dtype": "float32",
                                     "kv_cache_bytes": None, "max_model_len": 512,
                                     "gpu_memory_utilization": min(0.95, (total - free) / total
                                                                   + 0.05), **kw})


def _generate(runner, prompts, max_tokens):
    """Prompts in groups of three (one prefill step each, then decode)."""
    out = {}
    for start in range(0, len(prompts), 3):
        planner = Planner(BLOCK_SIZE, runner.num_kv_blocks)
        for i, p in enumerate(prompts[start:start + 3]):
            planner.add(start + i, p, max_tokens)
        out.update(planner.run(runner))
        runner.table = runner.new_table(runner.num_kv_blocks)
    return out


def _count_replays(monkeypatch) -> list:
    from gpu_workers.prefill_graphs import PrefillGraphs

    keys = []
    run = PrefillGraphs.run

    def counted(self, ids, positions, attn, key):
        keys.append(key)
        return run(self, ids, positions, attn, key)

    monkeypatch.setattr(PrefillGraphs, "run", counted)
    return keys


def _late_arrival(runner, prompts, late, max_tokens):
    """The prompts decode for three steps, then `late` joins them: a mixed step."""
    planner = Planner(BLOCK_SIZE, runner.num_kv_blocks)
    for i, p in enumerate(prompts):
        planner.add(i, p, max_tokens)
    for _ in range(3):
        planner.apply(runner.execute(planner.plan()))
    planner.add(len(prompts), late, max_tokens)
    return planner.run(runner)


def test_prefill_graphs_match_eager(tiny_qwen3_dir, monkeypatch):
    keys = _count_replays(monkeypatch)
    prompts = random_prompts(5, [1, 7, 16, 17, 100, 129, 300, 64, 3])
    eager = _generate(_runner(tiny_qwen3_dir, enforce_eager=True), prompts, 8)
    assert not keys
    graphed = _generate(_runner(tiny_qwen3_dir), prompts, 8)
    assert graphed == eager
    assert {(4, 128), (4, 512)} <= set(keys)


@pytest.mark.parametrize("decoding,bucket", [(10, (16, 512)), (30, (64, 512))])
def test_a_prompt_joining_decoding_sequences_replays_a_graph(tiny_qwen3_dir, monkeypatch,
                                                              decoding, bucket):
    keys = _count_replays(monkeypatch)
    prompts = random_prompts(6, [3 + (7 * i) % 40 for i in range(decoding)])
    late = random_prompts(7, [300])[0]
    eager = _late_arrival(_runner(tiny_qwen3_dir, enforce_eager=True, max_num_seqs=64), prompts,
                          late, 8)
    assert not keys
    graphed = _late_arrival(_runner(tiny_qwen3_dir, max_num_seqs=64), prompts, late, 8)
    assert graphed == eager
    assert bucket in keys  # the decoding rows and the 300-token prompt
