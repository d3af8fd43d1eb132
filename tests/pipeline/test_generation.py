"""Tokens through the whole pipeline equal transformers' greedy tokens."""

from __future__ import annotations

import concurrent.futures as cf
import re

import pytest
from hf_reference import hf_greedy
from pipeline_config import tiny_engine
from transformers import AutoTokenizer

from frontend import LLM, Client
from protocol import SamplingParams

PROMPTS = [
    "The quick brown fox",
    "Once upon a time there was a little model that",
    "a",
    "Numbers: one two three four five six seven eight nine ten eleven twelve thirteen",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _expected(model_dir: str) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    return [hf_greedy(model_dir, tok(p)["input_ids"], GREEDY.max_tokens) for p in PROMPTS]


def test_start_up_says_where_its_time_went(qwen3_pipeline):
    startup = qwen3_pipeline.startup
    assert [p.name for p in startup.phases] == ["checks", "processes", "weights", "kv",
                                                "warm-up", "graphs", "frontend"]
    assert min(p.seconds for p in startup.phases) >= 0
    assert sum(p.seconds for p in startup.phases) == pytest.approx(startup.total_s, abs=1e-3)
    assert startup.phase("weights") > 0 and startup.phase("kv") > 0
    by_name = {p.name: p for p in startup.processes}
    assert sorted(by_name) == ["detokenizer 0", "scheduler 0", "tokenizer 0", "worker 0"]
    assert by_name["tokenizer 0"].phase("tokenizer") > 0
    assert re.fullmatch(r"ready in \d+\.\d s \(checks \d+\.\d, processes \d+\.\d, "
                        r"weights \d+\.\d, kv \d+\.\d, warm-up \d+\.\d, graphs \d+\.\d, "
                        r"frontend \d+\.\d\)", startup.line())


def test_streaming_and_final_results_match_transformers(qwen3_pipeline, tiny_qwen3_dir):
    expected = _expected(tiny_qwen3_dir)
    with Client(qwen3_pipeline.address) as client:
        with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
            streamed = list(pool.map(
                lambda p: [t for d in client.stream(p, params=GREEDY) for t in d.token_ids],
                PROMPTS,
            ))
        finals = [client.generate(p, params=GREEDY) for p in PROMPTS]
    assert streamed == expected
    assert [f.token_ids for f in finals] == expected
    tok = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    for final in finals:
        assert final.finish_reason == "length"
        assert final.completion_tokens == GREEDY.max_tokens
        assert final.text == tok.decode(final.token_ids, skip_special_tokens=True)


def test_prefix_cache_hits_give_the_same_tokens(qwen3_pipeline, tiny_qwen3_dir):
    tok = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    shared = tok(" ".join(["the system prompt is long and shared"] * 12))["input_ids"]
    prompts = [shared + tok(f" question {i}")["input_ids"] for i in range(3)]
    with Client(qwen3_pipeline.address) as client:
        first = client.generate(prompt_token_ids=prompts[0], params=GREEDY)
        rest = [client.generate(prompt_token_ids=p, params=GREEDY) for p in prompts]
    assert first.token_ids == rest[0].token_ids
    for p, out in zip(prompts, rest):
        assert out.token_ids == hf_greedy(tiny_qwen3_dir, p, GREEDY.max_tokens)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_offline_llm_overlap_on_and_off_match_transformers(arch, request):
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    expected = _expected(model_dir)
    outputs = {}
    for mode in ("overlap", "lookahead", "two ahead", "off"):
        # Small token budget and KV pool: chunked prefill and preemption are exercised too.
        cfg = tiny_engine(model_dir, overlap=mode != "off",
                          worker_lookahead=mode in ("lookahead", "two ahead"),
                          plans_ahead=2 if mode == "two ahead" else 1,
                          max_num_batched_tokens=32)
        with LLM(**cfg) as llm:
            outputs[mode] = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    # Everything but the timings (metrics) agrees.
    same = {mode: [{k: v for k, v in o.items() if k != "metrics"} for o in outs]
            for mode, outs in outputs.items()}
    assert same["overlap"] == same["lookahead"] == same["two ahead"] == same["off"]
    assert [o["token_ids"] for o in outputs["overlap"]] == expected


def test_offline_llm_returns_logprobs_when_asked(tiny_llama_dir):
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    asked = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=True,
                           top_logprobs=3)
    with LLM(**tiny_engine(tiny_llama_dir)) as llm:
        without, with_lp = llm.generate([PROMPTS[0]] * 2, [plain, asked], use_tqdm=False)
    assert set(without) == {"text", "token_ids", "finish_reason", "metrics"}
    assert without["finish_reason"] == with_lp["finish_reason"] == "length"
    assert with_lp["token_ids"] == without["token_ids"]
    assert len(with_lp["logprobs"]) == len(with_lp["top_logprobs"]) == 6
    for token, lp, top in zip(with_lp["token_ids"], with_lp["logprobs"],
                              with_lp["top_logprobs"], strict=True):
        assert len(top) == 3 and top[0][0] == token and top[0][1] == pytest.approx(lp, abs=1e-5)


@pytest.mark.parametrize("plans_ahead", [1, 2])
def test_tensor_parallel_2_matches_transformers(tiny_qwen3_dir, capfd, plans_ahead):
    expected = _expected(tiny_qwen3_dir)
    cfg = tiny_engine(tiny_qwen3_dir, tensor_parallel_size=2, worker_lookahead=True,
                      plans_ahead=plans_ahead)
    with LLM(**cfg) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=True)
    assert [o["token_ids"] for o in outputs] == expected
    bar = capfd.readouterr().err  # the progress bar reports throughput as vLLM's does
    assert f"{len(PROMPTS)}/{len(PROMPTS)}" in bar and "input:" in bar and "output:" in bar


def test_64_concurrent_streams(qwen3_pipeline):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=16, ignore_eos=True)
    prompts = [f"request number {i} says" for i in range(64)]
    with Client(qwen3_pipeline.address) as client:
        with cf.ThreadPoolExecutor(64) as pool:
            results = list(pool.map(lambda p: list(client.stream(p, params=params)), prompts))
        again = client.generate(prompts[5], params=params)
    for deltas in results:
        assert sum(len(d.token_ids) for d in deltas) == 16
        assert deltas[-1].finish_reason == "length"
    # A seeded request is reproducible whatever else is in the batch.
    assert [t for d in results[5] for t in d.token_ids] == again.token_ids


def test_repetition_penalty_through_the_pipeline(qwen3_pipeline, tiny_qwen3_dir):
    """A penalty reaches the worker's sampler and equals transformers' repetition_penalty."""
    tok = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    prompt = tok(PROMPTS[1])["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.8)
    with Client(qwen3_pipeline.address) as client:
        out = client.generate(prompt_token_ids=prompt, params=params)
        plain = client.generate(prompt_token_ids=prompt, params=GREEDY)
    assert out.token_ids == hf_greedy(tiny_qwen3_dir, prompt, 24, repetition_penalty=1.8)
    assert out.token_ids != plain.token_ids


def test_top_logprobs_through_the_pipeline(qwen3_pipeline):
    """Each greedy token is the best of its step's alternatives; each request gets as many
    alternatives as it asked for, also when a batch-mate asked for more."""
    wide = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=True,
                          top_logprobs=5)
    narrow = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=True,
                            top_logprobs=2)
    with Client(qwen3_pipeline.address) as client:
        with cf.ThreadPoolExecutor(2) as pool:
            a, b = pool.map(lambda p: client.generate(PROMPTS[0], params=p), [wide, narrow])
        streamed = [d for d in client.stream(PROMPTS[0], params=wide)]
        plain = client.generate(PROMPTS[0], params=SamplingParams(
            temperature=0, max_tokens=12, ignore_eos=True, logprobs=True))
    assert plain.top_logprobs is None
    for out, k in ((a, 5), (b, 2)):
        assert out.token_ids == plain.token_ids
        assert len(out.top_logprobs) == len(out.token_ids)
        for token, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True):
            assert len(top) == k and len({t for t, _ in top}) == k
            assert top[0][0] == token and top[0][1] == pytest.approx(lp, abs=1e-5)
            assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    streamed_top = [t for d in streamed for t in d.top_logprobs]
    assert [[t for t, _ in top] for top in streamed_top] == [[t for t, _ in top]
                                                              for top in a.top_logprobs]
    assert [v for top in streamed_top for _, v in top] == pytest.approx(
        [v for top in a.top_logprobs for _, v in top], abs=1e-5)  # other batch, other sums
