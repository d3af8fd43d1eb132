"""Speculative decoding through the whole pipeline (TP=2 over gloo), as a user runs it."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipeline"))
from hf_reference import hf_greedy  # noqa: E402
from pipeline_config import tiny_engine  # noqa: E402
from spec_helpers import repeating_prompt  # noqa: E402

from frontend import LLM, Client  # noqa: E402
from frontend.client.outputs import RequestRejected  # noqa: E402
from protocol import SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def spec_llm(tiny_qwen3_dir):
    with LLM(**tiny_engine(tiny_qwen3_dir, tensor_parallel_size=2, speculative="ngram",
                           num_speculative_tokens=4, ngram_size=2)) as llm:
        yield llm


def test_greedy_tp2_equals_transformers(spec_llm, tiny_qwen3_dir):
    # Speculation runs with the defaults: overlap and worker lookahead on.
    config = spec_llm.config
    assert config.max_plans_in_flight == 2 and config.worker_config("x").lookahead
    rng = random.Random(1)
    prompts = [repeating_prompt(rng, rng.randint(10, 40), rng.randint(3, 8)) for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    out = spec_llm.generate(prompts, params, use_tqdm=False)
    for prompt, result in zip(prompts, out, strict=True):
        assert result["token_ids"] == hf_greedy(tiny_qwen3_dir, prompt, 40)
        assert result["finish_reason"] == "length"


def test_stop_token_and_max_tokens_are_never_overshot(spec_llm, tiny_qwen3_dir):
    rng = random.Random(2)
    prompt = repeating_prompt(rng, 30, 5)
    expected = hf_greedy(tiny_qwen3_dir, prompt, 40)
    stop = expected[17]  # a token the greedy run produces, likely inside an accepted run
    first = expected.index(stop)
    out = spec_llm.generate(
        [prompt, prompt],
        [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop]),
         SamplingParams(temperature=0, max_tokens=13, ignore_eos=True)], use_tqdm=False)
    assert out[0]["token_ids"] == expected[:first + 1]
    assert out[0]["finish_reason"] == "stop"
    assert out[1]["token_ids"] == expected[:13]
    assert out[1]["finish_reason"] == "length"


def test_logprobs_follow_the_accepted_tokens(spec_llm, tiny_qwen3_dir):
    rng = random.Random(3)
    prompt = repeating_prompt(rng, 24, 4)
    out = spec_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20,
                                                     ignore_eos=True, logprobs=True,
                                                     top_logprobs=2), use_tqdm=False)[0]
    assert out["token_ids"] == hf_greedy(tiny_qwen3_dir, prompt, 20)
    assert len(out["logprobs"]) == len(out["top_logprobs"]) == 20
    for tok, lp, top in zip(out["token_ids"], out["logprobs"], out["top_logprobs"], strict=True):
        assert top[0][0] == tok and top[0][1] == pytest.approx(lp, abs=1e-5)


def test_penalties_are_refused_naming_the_field(spec_llm):
    with Client(spec_llm.pipeline.address) as client:
        with pytest.raises(RequestRejected) as err:
            client.generate(prompt_token_ids=[5, 6, 7],
                            params=SamplingParams(frequency_penalty=0.5))
        assert err.value.field == "params.frequency_penalty"
        assert client.generate(prompt_token_ids=[5, 6, 7],
                               params=SamplingParams(max_tokens=3)).token_ids
