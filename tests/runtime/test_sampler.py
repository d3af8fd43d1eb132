"""Sampler: greedy, top-k/top-p/min-p masks, seeds, mixed batches, logprobs."""

from __future__ import annotations

import torch
from random_prompts import random_prompts
from rt_helpers import BLOCK_SIZE, make_runner
from rt_planner import Planner

from gpu_workers.sampler import Sampler, SamplingBatch, row_seed, sampled_logprobs, top_logprobs
from protocol import SamplingParams


def _batch(rows: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeded=(),
           logprobs=False) -> SamplingBatch:
    def col(v, dtype):
        return torch.as_tensor(v if isinstance(v, list) else [v] * rows, dtype=dtype)

    temp = col(temperature, torch.float32)
    k = col(top_k, torch.int32)
    p = col(top_p, torch.float32)
    m = col(min_p, torch.float32)
    rand = temp > 0
    return SamplingBatch(
        temperature=temp, top_k=k, top_p=p, min_p=m,
        all_greedy=bool((~rand).all()), any_greedy=bool((~rand).any()),
        max_top_k=int(k[rand].max()) if rand.any() else 0,
        use_top_p=bool((p[rand] < 1).any()), use_min_p=bool((m[rand] > 0).any()),
        seeded=list(seeded), logprobs=logprobs,
    )


def _logits(rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_and_top_k_one_equal_argmax():
    logits = _logits(64)
    sampler = Sampler("cpu", seed=0)
    greedy, _ = sampler(logits, _batch(64, temperature=0.0))
    top1, _ = sampler(logits, _batch(64, temperature=1.5, top_k=1))
    assert torch.equal(greedy, logits.argmax(-1))
    assert torch.equal(top1, greedy)


def test_mixed_greedy_and_random_rows():
    logits = _logits(8)
    temps = [0.0, 1.0] * 4
    tokens, _ = Sampler("cpu", 1)(logits, _batch(8, temperature=temps))
    assert torch.equal(tokens[::2], logits[::2].argmax(-1))


def _probs_logits(probs: list[float], rows: int) -> torch.Tensor:
    return torch.tensor(probs).log().expand(rows, -1).clone()


def test_top_p_keeps_the_smallest_covering_set():
    logits = _probs_logits([0.5, 0.3, 0.15, 0.05], 4000)
    tokens, _ = Sampler("cpu", 2)(logits, _batch(4000, top_p=0.7))
    assert set(tokens.tolist()) == {0, 1}


def test_min_p_masks_tokens_below_the_scaled_floor():
    logits = _probs_logits([0.5, 0.3, 0.15, 0.05], 4000)
    tokens, _ = Sampler("cpu", 3)(logits, _batch(4000, min_p=0.4))  # floor 0.2
    assert set(tokens.tolist()) == {0, 1}


def test_top_k_restricts_to_k_best():
    logits = _probs_logits([0.1, 0.4, 0.2, 0.3], 4000)
    tokens, _ = Sampler("cpu", 4)(logits, _batch(4000, top_k=2))
    assert set(tokens.tolist()) == {1, 3}


def test_temperature_one_matches_the_distribution():
    probs = [0.5, 0.3, 0.15, 0.05]
    tokens, _ = Sampler("cpu", 5)(_probs_logits(probs, 20000), _batch(20000))
    freq = torch.bincount(tokens, minlength=4).float() / 20000
    assert torch.allclose(freq, torch.tensor(probs), atol=0.015)


def test_seeded_rows_reproduce_regardless_of_batch_and_global_state():
    logits = _logits(4)
    seeded = [(1, row_seed(1234, 5)), (3, row_seed(99, 0))]
    a, _ = Sampler("cpu", 0)(logits, _batch(4, seeded=seeded))
    b, _ = Sampler("cpu", 777)(logits, _batch(4, seeded=seeded))
    assert a[1] == b[1] and a[3] == b[3]
    draws = {
        Sampler("cpu", 0)(logits[:1], _batch(1, seeded=[(0, row_seed(1234, n))]))[0].item()
        for n in range(20)
    }
    assert len(draws) > 1  # the seed advances with the number of generated tokens


def test_logprobs_of_sampled_tokens():
    logits = _logits(6)
    tokens, lp = Sampler("cpu", 0)(logits, _batch(6, temperature=[0.0, 0.7] * 3,
                                                  logprobs=True))
    expect = torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1)
    assert torch.allclose(lp, expect)


def _run_seeded(model_dir: str, preempt_at: int | None) -> list[int]:
    runner = make_runner(model_dir)
    planner = Planner(BLOCK_SIZE, runner.num_kv_blocks)
    (p,) = random_prompts(11, [9])
    planner.add(0, p, 16, SamplingParams(temperature=0.9, top_p=0.95, seed=42))
    step = 0
    while (plan := planner.plan()) is not None:
        planner.apply(runner.execute(plan))
        step += 1
        if step == preempt_at:
            planner.preempt(0)
    return planner.seqs[0].output


def test_seeded_request_reproduces_across_preemption(tiny_llama_dir):
    plain = _run_seeded(tiny_llama_dir, None)
    assert _run_seeded(tiny_llama_dir, None) == plain
    assert _run_seeded(tiny_llama_dir, 6) == plain


def test_runner_returns_logprobs_when_asked(tiny_qwen3_dir):
    runner = make_runner(tiny_qwen3_dir)
    planner = Planner(BLOCK_SIZE, runner.num_kv_blocks)
    planner.add(0, [5, 6, 7], 2, SamplingParams(temperature=0.0, logprobs=True))
    result = runner.execute(planner.plan())
    assert result.logprobs is not None and len(result.logprobs) == 1
    assert result.logprobs[0] <= 0.0


def test_a_sampled_tokens_logprob_is_its_top_logprobs_entry_to_the_bit(tiny_qwen3_dir):
    """The two lists come from one formula; an HTTP client compares them."""
    runner = make_runner(tiny_qwen3_dir)
    planner = Planner(BLOCK_SIZE, runner.num_kv_blocks)
    planner.add(0, [5, 6, 7], 2, SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3))
    result = runner.execute(planner.plan())
    assert result.top_token_ids[0][0] == result.token_ids[0]
    assert result.top_logprobs[0][0] == result.logprobs[0]
    logits = _logits(4)
    ids, values = top_logprobs(logits, 3)
    assert torch.equal(values[:, 0], sampled_logprobs(logits, ids[:, 0]))
