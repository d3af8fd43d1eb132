"""The fused q/k-norm + rotary + KV-store path and the op-by-op path it replaced give the same
tokens as transformers; a runner built with CausalLM(fused_qkv=False) takes the op-by-op one."""

from __future__ import annotations

import functools

import pytest
from hf_reference import hf_greedy
from random_prompts import random_prompts
from rt_helpers import BLOCK_SIZE, make_runner
from rt_planner import Planner

from gpu_workers import model_runner
from gpu_workers.models import CausalLM


def _generate(runner, ps, max_tokens):
    planner = Planner(BLOCK_SIZE, runner.num_kv_blocks)
    for i, p in enumerate(ps):
        planner.add(i, p, max_tokens)
    return planner.run(runner)


@pytest.mark.parametrize("model", ["tiny_qwen3_dir", "tiny_llama_dir"])
def test_fused_and_unfused_paths_equal_transformers(model, request, monkeypatch):
    model_dir = request.getfixturevalue(model)
    ps = random_prompts(31, [1, 9, 40])
    want = {i: hf_greedy(model_dir, p, 8) for i, p in enumerate(ps)}
    fused = make_runner(model_dir, attention_backend="triton")
    assert fused.model.fused_qkv
    assert _generate(fused, ps, 8) == want
    monkeypatch.setattr(model_runner, "CausalLM", functools.partial(CausalLM, fused_qkv=False))
    unfused = make_runner(model_dir, attention_backend="triton")
    assert not unfused.model.fused_qkv
    assert _generate(unfused, ps, 8) == want
