"""Prefill/decode disaggregation on one GPU, as a single-H200 user runs it: the prefill and
decode replicas share the device, and the greedy tokens equal one colocated pipeline's with
either way of moving the KV (float32, so batching cannot move a token), prefix hits and
chunked prefill included; every request that decodes past its first token was handed off."""

from __future__ import annotations

import pytest
import torch
from pipeline_config import tiny_engine
from random_prompts import random_prompts

from frontend import LLM
from protocol import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def prompts() -> list[list[int]]:
    out = random_prompts(11, [1, 9, 33, 70, 150, 230])
    shared = out[-1][:160]  # prefix hits on the prefill replica, then on the decode one
    return out + [shared + [5, 7, 11], shared + [13, 17]]


def generate(model_dir: str, **kw) -> list[dict]:
    free, total = torch.cuda.mem_get_info()
    used = (total - free) / total
    cfg = tiny_engine(model_dir, device="cuda", dtype="float32", max_model_len=512,
                      max_num_batched_tokens=128, gpu_memory_utilization=min(0.95, used + 0.1),
                      **kw)
    with LLM(**cfg) as llm:
        return llm.generate(prompts(), PARAMS, use_tqdm=False)


@pytest.fixture(scope="module")
def colocated(tiny_qwen3_dir) -> list[dict]:
    return generate(tiny_qwen3_dir)


@pytest.mark.parametrize("transfer", ["frames", "shared"])
def test_one_gpu_split_gives_the_colocated_tokens(tiny_qwen3_dir, colocated, transfer):
    split = generate(tiny_qwen3_dir, prefill_replicas=1, decode_replicas=1,
                     kv_transfer=transfer)
    assert [r["token_ids"] for r in split] == [r["token_ids"] for r in colocated]
    assert all(r["metrics"].kv_transfer_s is not None for r in split)
