"""Greedy tokens of the runtime equal transformers' generate, token for token."""

from __future__ import annotations

import pytest
from hf_reference import hf_greedy
from random_prompts import random_prompts
from rt_helpers import BLOCK_SIZE, make_runner
from rt_planner import Planner

MODELS = ["tiny_qwen3_dir", "tiny_llama_dir"]


@pytest.fixture(params=MODELS)
def model_dir(request) -> str:
    return request.getfixturevalue(request.param)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_mixed_prompt_lengths(model_dir, backend):
    runner = make_runner(model_dir, attention_backend=backend)
    planner = Planner(BLOCK_SIZE, runner.num_kv_blocks)
    ps = random_prompts(0, [1, 7, 16, 17, 40, 95])
    for i, p in enumerate(ps):
        planner.add(i, p, max_tokens=10 + i)
    out = planner.run(runner)
    for i, p in enumerate(ps):
        assert out[i] == hf_greedy(model_dir, p, 10 + i), f"sequence {i}"


def test_chunked_prefill_next_to_decodes(model_dir):
    runner = make_runner(model_dir)
    planner = Planner(BLOCK_SIZE, runner.num_kv_blocks)
    short, long = random_prompts(1, [5, 70])
    planner.add(0, short, max_tokens=16)
    planner.add(1, long, max_tokens=8)
    # Sequence 1's prompt arrives in chunks of 9 tokens while sequence 0 decodes beside it.
    for _ in range(8):
        planner.apply(runner.execute(planner.plan(chunks={1: 9})))
    out = planner.run(runner)
    assert out[0] == hf_greedy(model_dir, short, 16)
    assert out[1] == hf_greedy(model_dir, long, 8)


def test_prefix_blocks_shared_with_num_computed(model_dir):
    runner = make_runner(model_dir)
    planner = Planner(BLOCK_SIZE, runner.num_kv_blocks)
    (base,) = random_prompts(2, [45])
    first = planner.add(0, base, max_tokens=4)
    planner.run(runner)
    # Same first two full blocks, different tail: reuse those blocks, compute only the rest.
    second_prompt = base[: 2 * BLOCK_SIZE] + random_prompts(3, [9])[0]
    planner.add(1, second_prompt, max_tokens=12, shared_blocks=first.blocks[:2],
                num_cached=2 * BLOCK_SIZE)
    out = planner.run(runner)
    assert out[0] == hf_greedy(model_dir, base, 4)
    assert out[1] == hf_greedy(model_dir, second_prompt, 12)


def test_preempted_sequence_resent_in_full(model_dir):
    runner = make_runner(model_dir)
    planner = Planner(BLOCK_SIZE, runner.num_kv_blocks)
    a, b = random_prompts(4, [20, 33])
    planner.add(0, a, max_tokens=20)
    planner.add(1, b, max_tokens=20)
    for _ in range(7):
        planner.apply(runner.execute(planner.plan()))
    planner.preempt(0)  # dropped now, re-sent with prompt + its 6 generated tokens
    planner.apply(runner.execute(planner.plan()))
    out = planner.run(runner)
    assert out[0] == hf_greedy(model_dir, a, 20)
    assert out[1] == hf_greedy(model_dir, b, 20)


def test_decode_only_steps_sample_every_entry(tiny_qwen3_dir):
    runner = make_runner(tiny_qwen3_dir)
    planner = Planner(BLOCK_SIZE, runner.num_kv_blocks)
    for i, p in enumerate(random_prompts(5, [3, 4, 5])):
        planner.add(i, p, max_tokens=5)
    planner.apply(runner.execute(planner.plan()))
    plan = planner.plan()
    assert not plan.new_seqs and plan.cached.num_new == [1, 1, 1]
    result = runner.execute(plan)
    assert result.step_id == plan.step_id and sorted(result.seq_ids) == [0, 1, 2]
    assert result.logprobs is None
