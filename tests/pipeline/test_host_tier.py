"""The host KV tier through LLM: prefixes pushed out of a tiny device pool come back from
host memory, and greedy tokens are those of the tier off and of transformers."""

from __future__ import annotations

import random

import pytest
import torch
from hf_reference import hf_greedy
from pipeline_config import kv_bytes_per_token, tiny_engine

from frontend import LLM
from protocol import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
CONTEXT_TOKENS = 160  # 10 blocks of 16
NUM_CONTEXTS = 4


def _conversations(vocab: int = 200) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, vocab) for _ in range(CONTEXT_TOKENS)]
            for _ in range(NUM_CONTEXTS)]


def _returning_turns(llm: LLM, contexts: list[list[int]]) -> list:
    """Every context with a first question, then each again with a second one: one at a
    time, so the other contexts push a context out of the device pool before it returns."""
    outs = []
    for turn in (1, 2):
        for ctx in contexts:
            outs += llm.generate([{"prompt_token_ids": ctx + [turn, turn + 1, turn + 2]}],
                                 GREEDY, use_tqdm=False)
    return outs


@pytest.mark.slow
def test_returning_contexts_reload_from_the_host_tier_with_identical_tokens(tiny_qwen3_dir):
    # The device pool holds one max_model_len sequence and a little more: about 1.5 contexts.
    pool = kv_bytes_per_token(tiny_qwen3_dir) * 272
    contexts = _conversations()
    results = {}
    for size in (0, 0.01):
        cfg = tiny_engine(tiny_qwen3_dir, kv_cache_bytes=pool, kv_offloading_size=size)
        with LLM(**cfg) as llm:
            results[size] = _returning_turns(llm, contexts)
    off, on = results[0], results[0.01]
    assert [o["token_ids"] for o in on] == [o["token_ids"] for o in off]
    second = [o["metrics"].cached_prompt_tokens for o in on[NUM_CONTEXTS:]]
    # Off, a returning context was evicted (at most the last one's blocks survive); on, all
    # of its 10 full blocks come back (the last block is always computed).
    assert all(c >= CONTEXT_TOKENS - 16 for c in second), second
    assert sum(o["metrics"].cached_prompt_tokens for o in off[NUM_CONTEXTS:]) < sum(second)
    # The request's metrics say which part came from host memory.
    host = [o["metrics"].host_prompt_tokens for o in on[NUM_CONTEXTS:]]
    assert sum(host) >= (NUM_CONTEXTS - 1) * (CONTEXT_TOKENS - 32), host
    assert all(h <= c for h, c in zip(host, second))
    assert not any(o["metrics"].host_prompt_tokens for o in off)
    first = contexts[0] + [2, 3, 4]
    assert on[NUM_CONTEXTS]["token_ids"] == hf_greedy(tiny_qwen3_dir, first, GREEDY.max_tokens)


def test_an_offloading_size_below_one_block_is_a_one_line_error(tiny_qwen3_dir):
    with pytest.raises(Exception, match="cannot hold one KV block") as err:
        LLM(**tiny_engine(tiny_qwen3_dir, kv_offloading_size=1e-9))
    assert "\n" not in str(err.value).strip()


@pytest.mark.slow
def test_the_client_sees_host_tier_hits_in_its_metrics_and_the_engine_stats(tiny_qwen3_dir):
    from test_engine_stats import StatsFollower

    from frontend import Client
    from frontend.engine.config import EngineConfig
    from frontend.engine.pipeline import Pipeline

    pool = kv_bytes_per_token(tiny_qwen3_dir) * 272
    config = EngineConfig(**tiny_engine(tiny_qwen3_dir, kv_cache_bytes=pool,
                                        kv_offloading_size=0.01, log_stats_interval=0))
    contexts = _conversations()
    with Pipeline(config) as pipeline, Client(pipeline.address) as client:
        follower = StatsFollower(pipeline.endpoints.deltas_pub)
        try:
            outs = [client.generate(prompt_token_ids=ctx + [turn], params=GREEDY)
                    for turn in (1, 2) for ctx in contexts]
            stats = follower.wait_for(lambda s: s.finished_requests == len(outs))
        finally:
            follower.close()
    host = sum(o.metrics.host_prompt_tokens for o in outs)
    assert host > 0 and stats.host_hit_tokens == host
    assert stats.host_blocks_loaded * 16 == host
    assert stats.host_blocks_stored >= stats.host_blocks_loaded
    assert 0 < stats.host_blocks_used <= stats.host_blocks_total == pipeline.num_host_slots
    ctx = contexts[1] + [2]
    assert outs[NUM_CONTEXTS + 1].token_ids == hf_greedy(tiny_qwen3_dir, ctx, GREEDY.max_tokens)



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_the_gpu_a_host_tier_hit_gives_the_tokens_of_a_device_cache_hit(tiny_qwen3_dir,
                                                                            dtype):
    # A device-cache hit and a host-tier hit compute the same new tokens after the same
    # cached prefix, so even in bf16 their tokens are identical if the blocks came back
    # exactly; recomputing the prefix (the tier off) may round differently in bf16.
    per_token = kv_bytes_per_token(tiny_qwen3_dir, itemsize=2 if dtype == "bfloat16" else 4)
    contexts = _conversations()
    results = {}
    for name, pool, size in (("tier", 272, 0.01), ("device cache", 2048, 0)):
        cfg = tiny_engine(tiny_qwen3_dir, device="cuda", dtype=dtype, block_size=16,
                          kv_cache_bytes=per_token * pool, kv_offloading_size=size)
        with LLM(**cfg) as llm:
            results[name] = _returning_turns(llm, contexts)
    tier, cached = results["tier"], results["device cache"]
    assert [o["token_ids"] for o in tier] == [o["token_ids"] for o in cached]
    host = [o["metrics"].host_prompt_tokens for o in tier[NUM_CONTEXTS:]]
    assert sum(host) >= (NUM_CONTEXTS - 1) * (CONTEXT_TOKENS - 32), host
    assert all(o["metrics"].cached_prompt_tokens >= CONTEXT_TOKENS - 16
               for o in cached[NUM_CONTEXTS:])
