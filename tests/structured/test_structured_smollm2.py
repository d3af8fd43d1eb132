"""Structured outputs end to end on the embedded SmolLM2 (CPU): every JSON answer parses and
validates against its schema, greedy and seeded sampling alike; choices, regexes and EBNF
grammars hold; unconstrained requests in the same batch are untouched."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from schemas import SCHEMAS

from frontend import LLM, SamplingParams

pytestmark = pytest.mark.slow
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    with LLM(smollm2_dir, device="cpu", dtype="float32", max_model_len=1024,
             max_num_seqs=32) as llm:
        yield llm


def _ask(name: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Answer in JSON: an example of a {name} record."}]


def _check_json(results, names):
    for name, result in zip(names, results, strict=True):
        assert result["finish_reason"] == "stop", (name, result["text"])
        jsonschema.validate(json.loads(result["text"]), SCHEMAS[name])


def test_json_schemas_greedy(llm):
    names = list(SCHEMAS)
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                             structured_outputs={"json": SCHEMAS[n]}) for n in names]
    _check_json(llm.chat([_ask(n) for n in names], params, use_tqdm=False), names)


def test_json_schemas_sampled_with_seeds_reproduce(llm):
    names = list(SCHEMAS)
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=MAX_TOKENS,
                             structured_outputs={"json": SCHEMAS[n]})
              for i, n in enumerate(names)]
    first = llm.chat([_ask(n) for n in names], params, use_tqdm=False)
    _check_json(first, names)
    again = llm.chat([_ask(n) for n in names[:4]], params[:4], use_tqdm=False)
    assert [r["text"] for r in again] == [r["text"] for r in first[:4]]


def test_choice_regex_grammar_and_json_object_beside_a_free_request(llm):
    prompts = ["The sky on a clear day is", "My phone number is", "Say yes or no:",
               "A JSON object describing a cat:", "Once upon a time"]
    params = [
        SamplingParams(temperature=0.8, seed=3, max_tokens=16,
                       structured_outputs={"choice": ["blue", "green", "grey sky"]}),
        SamplingParams(temperature=0, max_tokens=24,
                       structured_outputs={"regex": r"\(\d{3}\) \d{3}-\d{4}"}),
        SamplingParams(temperature=0, max_tokens=24, structured_outputs={
            "grammar": 'root ::= answer "!"\nanswer ::= "yes" | "no"'}),
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                       structured_outputs={"json_object": True}),
        SamplingParams(temperature=0, max_tokens=12),
    ]
    choice, phone, grammar, obj, free = llm.generate(prompts, params, use_tqdm=False)
    assert choice["text"] in ("blue", "green", "grey sky")
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", phone["text"]), phone["text"]
    assert grammar["text"] in ("yes!", "no!")
    assert obj["finish_reason"] == "stop" and isinstance(json.loads(obj["text"]), dict)
    alone = llm.generate(prompts[-1:], params[-1:], use_tqdm=False)[0]
    assert free["token_ids"] == alone["token_ids"]  # the masks touched only their own rows


def test_a_bad_schema_is_refused_before_the_engine(llm):
    from frontend import SamplingParamsError

    with pytest.raises(SamplingParamsError, match="structured_outputs.json"):
        SamplingParams(structured_outputs={"json": {"type": "integer", "minimum": "x"}})
