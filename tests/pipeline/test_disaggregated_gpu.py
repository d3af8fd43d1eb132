"""Prefill/decode disaggregation on GPUs, as users run it: on one GPU the prefill and decode
replicas share the device (a single H200); on two each replica has a GPU of its own and the
decode rank reads the prefill rank's pool through peer access (--kv-transfer auto picks
shared there). The greedy tokens equal one colocated pipeline's (float32, so batching cannot
move a token), prefix hits and chunked prefill included; every request that decodes past its
first token was handed off."""

from __future__ import annotations

import pytest
import torch
from pipeline_config import tiny_engine
from random_prompts import random_prompts

from frontend import LLM
from frontend.engine.config import EngineConfig
from frontend.engine.disagg import kv_transfer_mode
from frontend.engine.torch_build import visible_gpus
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
def test_one_gpu_split_gives_the_colocated_tokens(tiny_qwen3_dir, colocated, transfer,
                                                  monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible_gpus()[0])  # the replicas share it
    split = generate(tiny_qwen3_dir, prefill_replicas=1, decode_replicas=1,
                     kv_transfer=transfer)
    assert [r["token_ids"] for r in split] == [r["token_ids"] for r in colocated]
    assert all(r["metrics"].kv_transfer_s is not None for r in split)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_gpu_each_with_shared_pools_gives_the_colocated_tokens(tiny_qwen3_dir, colocated):
    if not torch.cuda.can_device_access_peer(1, 0):
        pytest.skip("the second GPU has no peer access to the first")
    split_cfg = dict(prefill_replicas=1, decode_replicas=1)
    assert kv_transfer_mode(EngineConfig(device="cuda", **split_cfg)) == "shared"
    split = generate(tiny_qwen3_dir, **split_cfg)
    assert [r["token_ids"] for r in split] == [r["token_ids"] for r in colocated]
    assert all(r["metrics"].kv_transfer_s is not None for r in split)
