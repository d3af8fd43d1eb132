"""LLM.generate's prompts in every shape users write them (vLLM's included): a string, token
ids (numpy's too), {"prompt"} / {"prompt_token_ids"} dicts, and lists or iterables of those,
each the same request as its plain form; a wrong shape is a TypeError naming the prompt, and
a closed LLM says it is closed."""

from __future__ import annotations

import numpy as np
import pytest
from pipeline_config import tiny_engine

from frontend import LLM
from protocol import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
IDS = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def llm(tiny_qwen3_dir):
    with LLM(**tiny_engine(tiny_qwen3_dir)) as llm:
        yield llm


def tokens(results: list[dict]) -> list[list[int]]:
    return [r["token_ids"] for r in results]


def test_every_shape_of_a_prompt_is_the_same_request(llm):
    by_text, by_ids = tokens(llm.generate(["The capital", IDS], GREEDY, use_tqdm=False))
    shapes = {
        "one string": ("The capital", [by_text]),
        "one list of ids": (IDS, [by_ids]),
        "a numpy row": (np.array(IDS, dtype=np.int64), [by_ids]),
        "numpy integers": ([np.int32(t) for t in IDS], [by_ids]),
        "vLLM's TextPrompt": ({"prompt": "The capital"}, [by_text]),
        "vLLM's TokensPrompt": ({"prompt_token_ids": IDS}, [by_ids]),
        "a mixed tuple": (("The capital", {"prompt_token_ids": IDS}), [by_text, by_ids]),
        "a generator": ((p for p in ["The capital", IDS]), [by_text, by_ids]),
        "a 2-D array": (np.array([IDS, IDS]), [by_ids, by_ids]),
        "nothing": ([], []),
    }
    for name, (prompts, expected) in shapes.items():
        assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected, name


@pytest.mark.parametrize("prompts, match", [
    (5, r"prompts must be a string, .* got int"),
    (None, r"prompts must be .* got NoneType"),
    (["fine", None], r"prompts\[1\] must be a string, .* got NoneType"),
    ({"prompt": "a", "multi_modal_data": {}}, r"one of \"prompt\" and \"prompt_token_ids\" "
                                              r"and nothing else; got \['multi_modal_data'"),
    ({"prompt": "a", "prompt_token_ids": IDS}, "one of"),
    ({"prompt": IDS}, r"prompts\['prompt'\] must be a string; got list"),
    ([{"prompt_token_ids": "abc"}], r"prompts\[0\]\['prompt_token_ids'\] must be a list"),
])
def test_a_misshapen_prompt_fails_before_anything_runs(llm, prompts, match):
    with pytest.raises(TypeError, match=match):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert len(llm.generate("still here", GREEDY, use_tqdm=False)[0]["token_ids"]) == 6


def test_n_completions_per_prompt(llm):
    """SamplingParams(n=...) as vLLM's: `outputs` holds the n completions of each prompt, the
    first also at the top level; a seeded prompt's completion j is seed + j's."""
    sampled = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=3)
    many, one = llm.generate(["The capital", IDS], [SamplingParams(
        temperature=1.0, max_tokens=6, ignore_eos=True, seed=3, n=3), sampled],
        use_tqdm=False)
    assert "outputs" not in one and len(many["outputs"]) == 3
    assert {k: many[k] for k in ("text", "token_ids")} == {
        k: many["outputs"][0][k] for k in ("text", "token_ids")}
    for j, completion in enumerate(many["outputs"]):
        alone = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=3 + j)
        [expected] = llm.generate("The capital", alone, use_tqdm=False)
        assert completion["token_ids"] == expected["token_ids"]
    assert len({tuple(c["token_ids"]) for c in many["outputs"]}) > 1
    greedy = llm.generate(IDS, SamplingParams(temperature=0, max_tokens=6, n=2),
                          use_tqdm=False)[0]["outputs"]
    assert greedy[0]["token_ids"] == greedy[1]["token_ids"]


def test_stop_none_is_no_stop_strings(llm):
    """As in vLLM: SamplingParams(stop=None), or a dict saying so, stops on nothing."""
    plain = tokens(llm.generate("The capital", GREEDY, use_tqdm=False))
    none = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop=None)
    as_dict = {"temperature": 0, "max_tokens": 6, "ignore_eos": True, "stop": None}
    assert tokens(llm.generate("The capital", none, use_tqdm=False)) == plain
    assert tokens(llm.generate("The capital", as_dict, use_tqdm=False)) == plain


def test_a_closed_llm_says_so(tiny_qwen3_dir):
    llm = LLM(**tiny_engine(tiny_qwen3_dir))
    assert len(llm.generate("hi", GREEDY, use_tqdm=False)) == 1
    llm.close()
    llm.close()  # twice is fine
    for call in (lambda: llm.generate("hi", GREEDY, use_tqdm=False),
                 lambda: llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)):
        with pytest.raises(RuntimeError, match="this LLM is closed"):
            call()


def test_generate_takes_each_output_whole(llm, monkeypatch):
    """A stream would be a message per request per step, to the detokenizer and to this
    process; on a small model's short steps the user's process fell behind the engine."""
    from frontend.client.async_client import AsyncClient

    deltas: list[str] = []
    next_delta = AsyncClient._next

    async def counted(self, request_id, q):
        delta = await next_delta(self, request_id, q)
        deltas.append(request_id)
        return delta

    monkeypatch.setattr(AsyncClient, "_next", counted)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    results = llm.generate(["The capital", IDS, IDS], params, use_tqdm=False)
    assert [len(r["token_ids"]) for r in results] == [12, 12, 12]
    assert len(deltas) == len(set(deltas)) == 3
