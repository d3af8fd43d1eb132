"""LLM.chat as vLLM's: the model's chat template with its generation prompt, then generation;
the engine's prompt and greedy output match transformers on the same template and weights."""

from __future__ import annotations

import pytest
from hf_reference import hf_greedy
from pipeline_config import tiny_engine
from transformers import AutoTokenizer

from frontend import LLM
from protocol import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
HELLO = [{"role": "user", "content": "Hello, who are you?"}]
TRIP = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Name a city in Italy."},
    {"role": "assistant", "content": "Rome."},
    {"role": "user", "content": [{"type": "text", "text": "Another"},
                                 {"type": "text", "text": "one?"}]},
]
TRIP_AS_TEXT = TRIP[:3] + [{"role": "user", "content": "Another\none?"}]


@pytest.fixture(scope="module")
def llm(tiny_qwen3_dir):
    with LLM(**tiny_engine(tiny_qwen3_dir)) as llm:
        yield llm


def _templated(model_dir: str, conversation: list[dict], **kwargs) -> list[int]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    kwargs.setdefault("add_generation_prompt", True)
    return tok.apply_chat_template(conversation, **kwargs)["input_ids"]


def test_chat_matches_transformers_on_the_templated_prompt(llm, tiny_qwen3_dir):
    prompts = [_templated(tiny_qwen3_dir, c) for c in (HELLO, TRIP_AS_TEXT)]
    expected = [hf_greedy(tiny_qwen3_dir, p, GREEDY.max_tokens) for p in prompts]
    # The prompt the engine used is exactly transformers' one: same greedy output as that
    # prompt given as token ids, and the same as transformers' generate.
    by_ids = llm.generate(prompts, GREEDY, use_tqdm=False)
    one = llm.chat(HELLO, GREEDY, use_tqdm=False)
    both = llm.chat([HELLO, TRIP], GREEDY, use_tqdm=False)
    assert [r["token_ids"] for r in by_ids] == expected
    untimed = lambda results: [{k: v for k, v in r.items() if k != "metrics"} for r in results]
    assert len(one) == 1 and untimed(one) == untimed(by_ids[:1])
    assert untimed(both) == untimed(by_ids)
    assert set(one[0]) == {"text", "token_ids", "finish_reason", "metrics"}
    assert one[0]["finish_reason"] == "length"


def test_chat_template_kwargs_reach_the_template(llm, tiny_qwen3_dir):
    without_gen = _templated(tiny_qwen3_dir, HELLO, add_generation_prompt=False)
    assert without_gen != _templated(tiny_qwen3_dir, HELLO)
    [out] = llm.chat(HELLO, GREEDY, use_tqdm=False,
                     chat_template_kwargs={"add_generation_prompt": False})
    assert out["token_ids"] == hf_greedy(tiny_qwen3_dir, without_gen, GREEDY.max_tokens)


def test_chat_takes_one_sampling_params_per_conversation(llm):
    short = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    a, b = llm.chat([HELLO, HELLO], [GREEDY, short], use_tqdm=False)
    assert len(a["token_ids"]) == 12 and b["token_ids"] == a["token_ids"][:3]
    with pytest.raises(ValueError, match="one per conversation"):
        llm.chat([HELLO, HELLO], [GREEDY], use_tqdm=False)


def test_sampling_params_may_be_a_dict_and_a_wrong_type_is_named(llm):
    as_dict = {"temperature": 0, "max_tokens": 3, "ignore_eos": True}
    [a, b] = llm.chat([HELLO, HELLO], as_dict, use_tqdm=False)
    [c] = llm.chat(HELLO, SamplingParams(**as_dict), use_tqdm=False)
    assert a["token_ids"] == b["token_ids"] == c["token_ids"] and len(c["token_ids"]) == 3
    for bad, message in [({"temprature": 0}, "unexpected keyword argument 'temprature'"),
                         ([GREEDY, "greedy"], r"sampling_params\[1\] must be a SamplingParams"),
                         ("greedy", "must be a SamplingParams or a list of them")]:
        with pytest.raises(TypeError, match=message):
            llm.chat([HELLO, HELLO], bad, use_tqdm=False)
    # A dict of two fields for two prompts is one SamplingParams, not one per prompt.
    assert len(llm.generate(["a", "b"], {"max_tokens": 2, "temperature": 0},
                            use_tqdm=False)) == 2


@pytest.mark.parametrize(("bad", "error", "message"), [
    ([], TypeError, "non-empty list"),
    ("hi", TypeError, "non-empty list"),
    ([HELLO, []], ValueError, r"conversations\[1\] must not be empty"),
    ([{"role": "wizard", "content": "hi"}], ValueError, r"messages\[0\]\.role must be one of"),
    ([{"role": "user"}], TypeError, r"messages\[0\]\.content must be a string"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], TypeError,
     r"messages\[0\]\.content\[0\] must be"),
])
def test_bad_conversations_fail_before_anything_runs(llm, bad, error, message):
    with pytest.raises(error, match=message):
        llm.chat(bad, GREEDY, use_tqdm=False)
    assert len(llm.chat(HELLO, GREEDY, use_tqdm=False)[0]["token_ids"]) == 12


def test_vllm_spellings_of_chat_and_the_tokenizer(llm, tiny_qwen3_dir):
    """vLLM's keywords: chat(messages=..., add_generation_prompt=False), get_tokenizer(), and
    a stop given as one string."""
    without_gen = _templated(tiny_qwen3_dir, HELLO, add_generation_prompt=False)
    [out] = llm.chat(messages=HELLO, sampling_params=GREEDY, use_tqdm=False,
                     add_generation_prompt=False)
    assert out["token_ids"] == hf_greedy(tiny_qwen3_dir, without_gen, GREEDY.max_tokens)
    tokenizer = llm.get_tokenizer()
    assert tokenizer.encode("Hello") == AutoTokenizer.from_pretrained(tiny_qwen3_dir).encode(
        "Hello")
    [plain] = llm.generate(["Hello"], GREEDY, use_tqdm=False)
    stop = plain["text"][len(plain["text"]) // 2:][:3]
    assert stop.strip(), plain["text"]
    [cut] = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=12, stop=stop),
                         use_tqdm=False)
    assert cut["finish_reason"] == "stop" and stop not in cut["text"]
    assert plain["text"].startswith(cut["text"])
    [kept] = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=12, stop=stop,
                                                    include_stop_str_in_output=True),
                          use_tqdm=False)
    assert kept["finish_reason"] == "stop" and kept["text"] == cut["text"] + stop
