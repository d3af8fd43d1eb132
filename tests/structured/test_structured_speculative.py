"""Structured outputs under `--speculative ngram` on the embedded SmolLM2 (CPU), through LLM:
greedy constrained answers (JSON schemas, a regex, a choice) are the tokens an engine without
speculation gives, beside an unconstrained request in the same batch; seeded sampled answers
validate; a required tool call is one; the requests' metrics count proposed and accepted
tokens."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from schemas import SCHEMAS

from frontend import LLM, SamplingParams

pytestmark = pytest.mark.slow
ENGINE = dict(device="cpu", dtype="float32", max_model_len=1024, max_num_seqs=16)
NAMES = ["person", "array_of_ints", "nested_address"]
EXAMPLES = {"person": '{"name": "Ann", "age": 31}', "array_of_ints": '{"numbers": [4, 8, 15]}',
            "nested_address": '{"name": "Bo", "address": {"city": "Oslo", "zip": "01234"}}'}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
    "required": ["city"]}}}


def _messages() -> list[list[dict[str, str]]]:
    asks = [f"Here is a {n} record in JSON: {EXAMPLES[n]}. Write another one." for n in NAMES]
    asks += ["Call (555) 123-4567 or (555) 123-9876. Give one more phone number.",
             "Is the sky blue? Answer yes or no.", "Tell me about the sea."]
    return [[{"role": "user", "content": a}] for a in asks]


def _params(temperature: float = 0.0) -> list[SamplingParams]:
    def p(i: int, **kw) -> SamplingParams:
        return SamplingParams(temperature=temperature, seed=40 + i if temperature else None,
                              max_tokens=96, **kw)
    return ([p(i, structured_outputs={"json": SCHEMAS[n]}) for i, n in enumerate(NAMES)]
            + [p(3, structured_outputs={"regex": PHONE}),
               p(4, structured_outputs={"choice": ["yes", "no"]}), p(5)])


def _check(out: list[dict]) -> None:
    for name, result in zip(NAMES, out, strict=False):
        assert result["finish_reason"] == "stop", (name, result["text"])
        jsonschema.validate(json.loads(result["text"]), SCHEMAS[name])
    assert re.fullmatch(PHONE, out[3]["text"]), out[3]["text"]
    assert out[4]["text"] in ("yes", "no")


@pytest.fixture(scope="module")
def reference(smollm2_dir) -> list[dict]:
    with LLM(smollm2_dir, **ENGINE) as llm:
        return llm.chat(_messages(), _params(), use_tqdm=False)


def test_ngram_speculation_keeps_constrained_answers(smollm2_dir, reference):
    _check(reference)
    with LLM(smollm2_dir, **ENGINE, speculative="ngram", num_speculative_tokens=4) as llm:
        out = llm.chat(_messages(), _params(), use_tqdm=False)
        assert [o["token_ids"] for o in out] == [o["token_ids"] for o in reference]
        proposed = sum(o["metrics"].spec_proposed_tokens for o in out[:5])
        accepted = sum(o["metrics"].spec_accepted_tokens for o in out[:5])
        assert 0 < accepted <= proposed
        sampled = llm.chat(_messages(), _params(0.8), use_tqdm=False)
        _check(sampled)
        asked = [{"role": "user", "content": "What is the weather in Oslo? Oslo, Norway."}]
        called = llm.chat(asked, SamplingParams(temperature=0, max_tokens=64), tools=[WEATHER],
                          tool_choice="required", use_tqdm=False)[0]
        call = called["tool_calls"][0]["function"]
        assert call["name"] == "get_weather"
        assert isinstance(json.loads(call["arguments"])["city"], str)
